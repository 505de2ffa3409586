"""The --reference oracle through the public CLI, and bad input -> exit 2 with one line."""

from __future__ import annotations

import json

import pytest

from meshllm.engine.weights import load_transformer
from tests.conftest import run_cli, write_gguf_model, write_hf_model


@pytest.mark.slow
def test_reference_paris_is_deterministic():
    args = ["--reference", "--chat", "--prompt", "What is the capital of France?", "--json", "--max-tokens", "16"]
    runs = [run_cli(*args) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    objs = [json.loads(r.stdout) for r in runs]
    assert objs[0] == objs[1]
    o = objs[0]
    assert "Paris" in o["text"]
    assert set(o) == {"prompt_token_ids", "token_ids", "margins", "text", "finish_reason"}
    assert len(o["margins"]) == len(o["token_ids"]) and o["finish_reason"] in ("stop", "length")
    assert o["prompt_token_ids"][0] == 1  # <|im_start|> from the chat template


@pytest.mark.slow
def test_reference_several_prompts_and_draft():
    r = run_cli("--reference", "--prompt", "One, two,", "--prompt", "Hello", "--max-tokens", "4", "--json",
                "--draft", "w4a16")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["results"]
    assert len(res) == 2 and all(len(x["token_ids"]) == 4 for x in res)


def test_reference_tiny_hf_model_end_to_end(tmp_path):
    d = write_hf_model(load_transformer("tiny"), tmp_path / "hf")
    outs = []
    for seed in (0, 0):
        r = run_cli("--reference", "--model", str(d), "--prompt", "the tin", "--chat", "--max-tokens", "6",
                    "--json", "--seed", str(seed), "--temperature", "0.7")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1] and len(outs[0]["token_ids"]) >= 1


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr  # one line naming the problem (argparse printed its usage block too)
    assert "Traceback" not in r.stderr
    assert any(all(n in ln for n in needles) for ln in lines), r.stderr
    assert r.stdout == ""


def test_bad_inputs_exit_2(tmp_path):
    _one_line_error(run_cli("--reference", "--model", str(tmp_path / "missing.gguf")), "missing.gguf", "no such")
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello")
    _one_line_error(run_cli("--reference", "--model", str(junk)), "junk.gguf", "not a GGUF")
    gpt2 = write_gguf_model(load_transformer("tiny"), tmp_path / "gpt2.gguf", arch="gpt2")
    _one_line_error(run_cli("--reference", "--model", str(gpt2)), "gpt2", "not Llama-family")
    _one_line_error(run_cli("--reference", "--draft", "w3a16"), "is not a draft", "w3a16")
    _one_line_error(run_cli("--reference", "--model", "llama-2-70b"), "shape-only")
    _one_line_error(run_cli("--reference", "--max-tokens", "0"), "--max-tokens")
    # groups the model's layers do not split into (was a ValueError, exit 1) or the int4 kernel does not take
    _one_line_error(run_cli("--reference", "--draft", "w4a16", "--group-size", "128"), "does not divide", "32, 64")
    _one_line_error(run_cli("--reference", "--draft", "w4a16", "--group-size", "96"), "must be one of")
    r = run_cli("--reference", "--prompt", "caf\udce9")  # a Latin-1 byte on the command line (was a TypeError)
    assert r.returncode == 2 and "not valid UTF-8 text" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--reference", "--bogus-flag")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


@pytest.mark.parametrize("args, problem", [
    (["--plan", ""], "--plan: the argument is empty"),
    (["--cluster", "clusters/demo.yaml", "--prompt", "hi", "--prompt", ""], "--prompt: an empty prompt encodes to zero"),
    (["--keygen", ""], "--keygen: the argument is empty"),
    (["--reference", "--model", ""], "--model: the argument is empty"),  # ran the embedded model
    (["--reference", "--threads", "0"], "--threads must be a number of threads in 1..1024"),
    (["--reference", "--threads", "100000"], "--threads must be a number of threads in 1..1024"),  # a segfault
    (["--status", "127.0.0.1:9", "--timeout", "1e300"], "--timeout must be a number of seconds in (0, 604800]"),
    (["--reference", "--temperature", "-1"], "--temperature must be in [0, 2]"),
    (["--reference", "--temperature", "2.5"], "--temperature must be in [0, 2]"),
    (["--reference", "--top-k", "-3"], "--top-k must be >= 0"),
    (["--reference", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--reference", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--plan", "clusters/demo.yaml", "--png", "/nonexistent/dir/plan.png"], "must be a .png file in a folder that exists"),
    (["--plan", "clusters/demo.yaml", "--png", "plan.txt"], "must be a .png file"),
    (["--reference", "--png", "x.png"], "--png applies to --plan only; it was given with --reference"),
    (["--reference", "--kill", "fog-1@1"], "--kill applies to --cluster only"),
    (["--simulate", "clusters/demo.yaml", "--serve"], "--serve applies to --cluster only; it was given with --simulate"),
    (["--cluster", "clusters/demo.yaml", "--model", "tiny"], "--model applies to --reference only (cluster and node"),
    (["--plan", "clusters/demo.yaml", "--temperature", "0.5"], "--temperature applies to --reference and --cluster only"),
    (["--node-config", "node.yaml", "--json"], "--json applies to"),
    (["--status", "127.0.0.1:9", "--seed", "3"], "--seed applies to --reference, --cluster, --plan and --simulate only"),
    # --serve takes its requests from the API: a fault or workload option was silently not applied
    (["--cluster", "clusters/demo.yaml", "--serve", "--kill", "fog-2@1"], "--kill applies to a --cluster run of a workload"),
    (["--cluster", "clusters/demo.yaml", "--serve", "--prompt", "hi"], "--prompt applies to a --cluster run"),
    (["--cluster", "clusters/demo.yaml", "--serve", "--json"], "--json applies to a --cluster run"),
    (["--cluster", "clusters/demo.yaml", "--serve", "--max-tokens", "5"], "--max-tokens applies to a --cluster run"),
    (["--reference", "--group-size", "128"], "--group-size applies to --draft"),  # was ignored
    (["--reference", "--draft", "w4a16", "--dtype", "bfloat16"], "--dtype applies to the target model"),  # ignored
    (["--reference", "--draft", "none"], "--draft 'none' is not a draft"),  # ran the fp32 target, undocumented
    (["--cluster", "clusters/demo.yaml", "--kill", "fog-1"], "--kill 'fog-1': expected NODE@S"),  # was: no node ''
    (["--cluster", "clusters/demo.yaml", "--restart", "fog-1"], "--restart 'fog-1': expected NODE@S"),
    (["--cluster", "clusters/demo.yaml", "--pause", "fog-1"], "--pause 'fog-1': expected NODE@S1-S2"),
    (["--plan", "clusters/demo.yaml", "--rate", "abc"], "argument --rate: invalid float value: 'abc' (see --help)"),
    (["--plan", "a", "--simulate", "b"], "not allowed with argument --plan"),  # argparse's usage block was 10 lines
    (["--cluster", "clusters/impossible.yaml"], "short"),  # the shortfall before "no prompts to run"
])
def test_an_option_out_of_range_or_that_its_mode_ignores_exits_2(args, problem):
    """Sampling options the API would refuse, options the chosen mode never reads (--png with
    --reference, --serve with --simulate, --model with --cluster: all ran as if not given), an
    empty mode argument (a StopIteration, exit 1) and an empty prompt to --cluster (its request
    failed after the mesh started) are bad input: one line, exit 2, before any model loads or
    process starts."""
    _one_line_error(run_cli(*args, timeout=60), problem)


def test_a_model_larger_than_the_available_memory_is_refused_before_it_loads(monkeypatch):
    """--reference loads the whole model in one process: one larger than this host's memory ended
    in a MemoryError traceback (exit 1) after minutes of loading. It is refused first (exit 2)."""
    import pytest

    from meshllm.engine import generate
    from meshllm.errors import InputError
    from meshllm.shapes import model_args

    real = generate.available_bytes()
    assert real is None or real > 1e8  # this host's /proc/meminfo, read
    monkeypatch.setattr(generate, "available_bytes", lambda: 8e9)
    with pytest.raises(InputError, match=r"llama-2-70b needs ~27\d\.\d GB \(fp32 weights\), this host has 8\.0 GB"):
        generate.check_room(model_args("llama-2-70b"), "fp32")
    generate.check_room(model_args("smollm2-135m"), "fp32")  # 0.5 GB
    monkeypatch.setattr(generate, "available_bytes", lambda: None)  # not Linux: no word
    generate.check_room(model_args("llama-2-70b"), "fp32")

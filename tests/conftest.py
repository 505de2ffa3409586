"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny model writers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # oracle data from llama.cpp (see its README)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def temp_files_under_pytest(tmp_path_factory: pytest.TempPathFactory):
    """Temporary files of the tests and of every process they start (an emulated cluster's node
    files and logs, which it keeps after a run it did not finish: interrupted, killed, timed out)
    go under pytest's own temporary directory, which pytest prunes, never loose in /tmp."""
    import tempfile

    tmp = str(tmp_path_factory.mktemp("tmp"))
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = tmp, None
    yield tmp
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


# run (as `python -S -c`) in a process the tests start, before it becomes the command: SIGTERM when
# pytest's process exits, however it exits; then exec the command (the death signal survives exec)
_DIE_WITH_PYTEST = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"  # pytest was gone before the prctl: no signal would come
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn(cmd: list[str], **popen) -> subprocess.Popen:
    """subprocess.Popen(cmd, **popen) for a process that must not outlive the test run. A pytest killed
    from outside (`timeout`, SIGTERM, -9) runs no fixture teardown, and a `--serve` launcher or a node
    whose parent dies keeps serving, as a server should: they did, for hours. So, on Linux, the process
    gets SIGTERM when pytest's process exits (PR_SET_PDEATHSIG, set in the child before it execs the
    command: its pid is the command's). The signal is bound to the thread that forks, so only a spawn
    from pytest's main thread gets it; a spawn from another thread is a plain Popen."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        cmd = [sys.executable, "-S", "-c", _DIE_WITH_PYTEST, str(os.getpid()), *map(str, cmd)]
    return subprocess.Popen(cmd, **popen)


def run_cli(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python launch.py ARGS` as a user would (a spawn: it ends if pytest dies); returns the
    completed process. Past `timeout` it is killed and subprocess.TimeoutExpired raised, as by
    subprocess.run."""
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, str(REPO / "launch.py"), *args]
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=e) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait_for(pred: Callable[[], bool], timeout_s: float = 15.0, every_s: float = 0.02) -> bool:
    """Poll `pred` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return pred()


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every live process, then SIGKILL the process group of any that outlives `timeout_s`."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="session")
def smollm2():
    from meshllm.engine.weights import load_transformer

    return load_transformer("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from meshllm.engine.tokenizer import load_tokenizer
    from meshllm.engine.weights import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def fixture_json():
    def load(name: str) -> dict:
        path = FIXTURES / name
        if not path.is_file():
            pytest.fail(f"oracle fixture {path} is missing")
        return json.loads(path.read_text())

    return load


def byte_bpe_tokenizer(vocab_size: int):
    """A byte-level BPE over the 256 byte symbols plus a few merges and ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    assert tok.get_vocab_size() <= vocab_size
    return tok


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_hf_model(model, path: Path) -> Path:
    """Save a full Transformer as an HF Llama checkpoint (rotate-half Q/K layout) + tokenizer."""
    from safetensors.torch import save_file

    from meshllm.engine.weights import _HF_LAYER, interleaved_to_hf

    a = model.args
    path.mkdir(parents=True, exist_ok=True)
    from meshllm.engine.model import unfuse_state_dict

    sd = {k: v.detach().float().contiguous() for k, v in unfuse_state_dict(model.state_dict(), a).items()}
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not a.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(a.n_layers):
        for hf, ours in _HF_LAYER.items():
            w = sd[f"layers.{i}.{ours}.weight"]
            if ours == "attention.wq":
                w = interleaved_to_hf(w, a.n_heads)
            elif ours == "attention.wk":
                w = interleaved_to_hf(w, a.n_kv_heads)
            out[f"model.layers.{i}.{hf}.weight"] = w.contiguous()
    save_file(out, str(path / "model.safetensors"))
    tok = byte_bpe_tokenizer(a.vocab_size)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "vocab_size": a.vocab_size, "intermediate_size": a.hidden_dim, "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": a.tie_embeddings, "eos_token_id": eos, "bos_token_id": None}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return path


def write_gguf_model(model, path: Path, arch: str = "llama", qtypes: dict[str, str] | None = None) -> Path:
    """Save a full Transformer as a GGUF file; `qtypes` maps a name fragment to F32/F16/Q8_0."""
    import gguf
    import numpy as np

    from meshllm.engine.weights import _GGUF_LAYER

    a = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.hidden_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_vocab_size(a.vocab_size)
    from meshllm.engine.model import unfuse_state_dict

    sd = {k: v.detach().float().numpy() for k, v in unfuse_state_dict(model.state_dict(), a).items()}
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not a.tie_embeddings:
        names["output.weight"] = "output.weight"
    for i in range(a.n_layers):
        for g, ours in _GGUF_LAYER.items():
            names[f"layers.{i}.{ours}.weight"] = f"blk.{i}.{g}.weight"
    for ours, gname in names.items():
        arr = np.ascontiguousarray(sd[ours])
        qt = next((q for frag, q in (qtypes or {}).items() if frag in gname), "F32")
        if qt == "F32" or arr.ndim == 1:
            w.add_tensor(gname, arr)
        elif qt == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[qt]
            w.add_tensor(gname, gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_model():
    from meshllm.engine.weights import load_transformer

    return load_transformer("tiny")

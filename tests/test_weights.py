"""Loading real and test-written model files; tokenizer and forward-pass oracles from llama.cpp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshllm.engine.model import SeqSpan
from meshllm.engine.weights import hf_to_interleaved, interleaved_to_hf, load_transformer, resolve_model
from meshllm.errors import ModelFileError
from tests.conftest import write_gguf_model, write_hf_model


def logits_of(model, ids: list[int]) -> torch.Tensor:
    c = model.new_cache()
    c.allocate(0)
    return model(torch.tensor(ids), [SeqSpan(0, 0, len(ids))], c)


def test_tokenizer_matches_llamacpp(smollm2_tokenizer, fixture_json):
    cases = fixture_json("smollm2_tokenizer.json")["cases"]
    assert len(cases) >= 20
    for c in cases:
        assert smollm2_tokenizer.encode(c["text"]) == c["ids"], c["text"]
        assert smollm2_tokenizer.decode(c["ids"]) == c["text"]


def test_tokenizer_special_tokens_and_digits(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("2026") == [tok.encode(d)[0] for d in "2026"]
    assert {0, 2} <= tok.eos_ids
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in chat


def test_a_long_text_is_tokenized_without_holding_the_gil(smollm2_tokenizer):
    """A gateway tokenizing a 4 MB prompt held the GIL for 2.7 s: its node's I/O thread starved
    and its peers declared it dead. A long text now goes through encode_batch, which lets go of
    it: another thread runs meanwhile (a handful of turns, not hundreds, when it did not), and
    the ids are encode's."""
    import threading
    import time

    text = "hello world " * 100_000
    turns, done = [0], threading.Event()

    def other() -> None:
        while not done.is_set():
            turns[0] += 1
            time.sleep(0.0005)

    th = threading.Thread(target=other)
    th.start()
    try:
        ids = smollm2_tokenizer.encode(text)
    finally:
        done.set()
        th.join()
    assert ids == smollm2_tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert turns[0] >= 20, turns

def test_forward_matches_llamacpp_logits(smollm2, fixture_json):
    data = fixture_json("smollm2_logits_llamacpp.json")
    assert len(data["cases"]) == 3
    for case in data["cases"]:
        lg = logits_of(smollm2, case["ids"])
        ref_top1 = [row[0] for row in case["top5_ids"]]
        ours = lg.argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(ours, ref_top1)) / len(ref_top1)
        diffs = [abs(lg[i, t].item() - case["top5_logits"][i][0]) for i, t in enumerate(ref_top1)]
        assert agree >= 0.9, f"top-1 agreement {agree:.2f}"
        assert max(diffs) <= 1.5, f"max |logit diff| at llama.cpp top-1 = {max(diffs):.3f}"


def test_embedded_model_metadata():
    src = resolve_model("smollm2-135m")
    a = src.args
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.vocab_size, a.tie_embeddings) == (
        30, 576, 9, 3, 49152, True)


def test_hf_permutation_roundtrip():
    w = torch.randn(12, 5)
    torch.testing.assert_close(hf_to_interleaved(interleaved_to_hf(w, 3), 3), w)


@pytest.mark.parametrize("name", ["tiny", "tiny-untied"])
def test_hf_safetensors_loads_same_logits(tmp_path, name):
    ref = load_transformer(name)
    d = write_hf_model(ref, tmp_path / "hf")
    loaded = load_transformer(str(d))
    ids = [3, 17, 42, 99, 5, 7, 250]
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(ref, ids), rtol=1e-5, atol=1e-5)
    shard = load_transformer(str(d), 1, 3)
    assert shard.start == 1 and len(shard.layers) == 2


def test_gguf_tensor_types_load(tmp_path):
    """F32/F16/Q4_0/Q5_1/Q8_0 tensors written with the gguf package load back exactly as gguf
    dequantizes them (Q4_1/Q8_0 are covered by the real file)."""
    import copy

    import gguf
    import numpy as np

    qtypes = {"attn_q": "F16", "attn_k": "Q4_0", "attn_v": "Q5_1", "ffn_": "Q8_0"}
    ref = load_transformer("tiny")
    loaded = load_transformer(str(write_gguf_model(ref, tmp_path / "t.gguf", qtypes=qtypes)))
    # the oracle: the same model with each tensor round-tripped through gguf's own (de)quantizer
    expected = copy.deepcopy(ref)
    with torch.no_grad():
        for m in expected.layers:
            for lin, key in ((m.attention.wqkv, None), (m.feed_forward.w13, "Q8_0"), (m.feed_forward.w2, "Q8_0")):
                w = lin.weight.detach().float().numpy()
                if key is None:  # rows: q (F16) | k (Q4_0) | v (Q5_1)
                    a = ref.args
                    q, k = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
                    parts = [(w[:q], "F16"), (w[q:q + k], "Q4_0"), (w[q + k:], "Q5_1")]
                else:
                    parts = [(w, key)]
                rows = []
                for arr, t in parts:
                    gt = gguf.GGMLQuantizationType[t]
                    rows.append(gguf.quants.dequantize(gguf.quants.quantize(arr.copy(), gt), gt).reshape(arr.shape))
                lin.load_state_dict({"weight": torch.from_numpy(np.concatenate(rows))})
    ids = [3, 17, 42, 99]
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(expected, ids), rtol=1e-4, atol=1e-4)
    exact = write_gguf_model(ref, tmp_path / "f32.gguf")
    torch.testing.assert_close(logits_of(load_transformer(str(exact)), ids), logits_of(ref, ids))


def test_gguf_reader_agrees_with_gguf_package_on_every_type(tmp_path):
    """Our fast header parser finds the same bytes as gguf.GGUFReader for legacy and K-quant types,
    and our dequantization (torch for F32/F16/Q4_0/Q4_1/Q8_0, gguf's for the rest) gives the same
    fp32 values bit for bit."""
    import gguf
    import numpy as np

    from meshllm.engine.gguf_file import GGUFFile

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16):
        w.add_tensor(f"t.{t.name}", gguf.quants.quantize(x, t), raw_dtype=t)
    w.add_tensor("t.F16", x.astype(np.float16))
    w.add_tensor("t.F32", x)
    block_bytes = {T.Q4_K: 144, T.Q6_K: 210}  # random K-quant blocks with small fp16 scales
    for t, nb in block_bytes.items():
        raw = rng.integers(0, 256, (3, nb), dtype=np.uint8)
        scale_at = [0, 2] if t == T.Q4_K else [nb - 2]
        for off in scale_at:
            raw[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        w.add_tensor(f"t.{t.name}", raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFile(tmp_path / "types.gguf")
    ref = gguf.GGUFReader(str(tmp_path / "types.gguf"))
    assert len(ref.tensors) == len(ours.tensors) == 10
    for t in ref.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(3, 256).astype(np.float32)
        got = ours.dequantize(t.name)
        assert got.shape == (3, 256) and got.dtype == np.float32 and got.flags.writeable, t.name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name


def test_a_gguf_header_s_alignment_is_checked(tmp_path):
    """A header (a model file, or one fetched from a peer) with general.alignment 0 was a
    ZeroDivisionError, a negative or odd one was taken; GGUF wants a multiple of 8."""
    import gguf
    import numpy as np

    from meshllm.engine.gguf_file import GGUFFile

    for align, ok in ((0, False), (12, False), (64, True)):
        w = gguf.GGUFWriter(str(tmp_path / f"a{align}.gguf"), "llama")
        w.data_alignment = 32  # the writer's own layout; the field is what a reader trusts
        w.add_uint32("general.alignment", align)
        w.add_tensor("t", np.zeros(32, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if ok:
            assert GGUFFile(tmp_path / f"a{align}.gguf", header_only=True).data_start % align == 0
        else:
            with pytest.raises(ModelFileError, match="general.alignment must be a positive multiple of 8"):
                GGUFFile(tmp_path / f"a{align}.gguf", header_only=True)


def test_malformed_tokenizer_fields_are_a_model_file_error():
    """The tokenizer is built from the GGUF header's fields (a peer's, for a gateway without the
    file): a field of the wrong type or length was a TypeError / IndexError / tokenizers' own
    Exception, which ended the gateway's tokenizer thread with a traceback."""
    from types import SimpleNamespace

    from meshllm.engine.tokenizer import tokenizer_from_gguf

    good = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<|im_end|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.eos_token_id": 3}
    tok = tokenizer_from_gguf(SimpleNamespace(fields=good))
    assert tok.eos_ids == {3} and tok.encode("ab") == [2]
    for key, bad in (("tokenizer.ggml.tokens", None), ("tokenizer.ggml.tokens", [1, 2]),
                     ("tokenizer.ggml.merges", [5]), ("tokenizer.ggml.merges", ["zz qq"]),
                     ("tokenizer.ggml.token_type", [1]), ("tokenizer.ggml.eos_token_id", "x")):
        with pytest.raises(ModelFileError, match="tokenizer fields are malformed"):
            tokenizer_from_gguf(SimpleNamespace(fields={**good, key: bad}))
    # the file is named, and a missing tokenizer is called that ("tokenizer model None" named neither)
    without = {k: v for k, v in good.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(ModelFileError, match=r"^/m/x\.gguf: no tokenizer \(tokenizer\.ggml\.model is missing\)$"):
        tokenizer_from_gguf(SimpleNamespace(fields=without, path="/m/x.gguf"))


def test_a_gguf_without_a_shape_key_names_it(tmp_path):
    """A GGUF whose metadata lacks llama.block_count said "incomplete or bad Llama metadata: int()
    argument must be a string ... not 'NoneType'"; it names the key now."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "nokey.gguf"), "llama")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(128)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"nokey\.gguf: Llama metadata without llama\.block_count$"):
        resolve_model(str(tmp_path / "nokey.gguf"))


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        resolve_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")  # it read as "no such file" too
    with pytest.raises(ModelFileError, match="a symbolic link that leads nowhere .*(symbolic links|loop)"):
        resolve_model(str(tmp_path / "loop.gguf"))
    (tmp_path / "gone.gguf").symlink_to(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="a symbolic link that leads nowhere"):
        resolve_model(str(tmp_path / "gone.gguf"))
    with pytest.raises(ModelFileError, match="not a regular file or a folder"):  # was "no such file"
        resolve_model("/dev/zero")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        resolve_model(str(junk))
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ModelFileError, match="corrupt"):
        resolve_model(str(trunc))
    other = write_gguf_model(load_transformer("tiny"), tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(ModelFileError, match="not Llama-family"):
        resolve_model(str(other))
    with pytest.raises(ModelFileError, match="shape-only"):
        resolve_model("llama-2-70b")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ModelFileError, match="config.json"):
        resolve_model(str(tmp_path / "emptydir"))


def test_a_model_file_whose_tensors_do_not_fit_its_metadata_is_refused_before_loading(tmp_path: Path) -> None:
    """Tensor shapes were never held to the metadata: a mismatch was torch's multi-line
    state_dict RuntimeError at load (exit 1), after the planner had taken the file; a corrupt
    safetensors file or tokenizer.json was the library's own exception; metadata arrays nested
    100,000 deep a RecursionError. Each is now a ModelFileError naming the file, found from
    the headers before anything loads."""
    import dataclasses
    import json
    from types import SimpleNamespace

    import gguf

    from meshllm.engine.tokenizer import load_tokenizer

    tiny = load_transformer("tiny")
    a = tiny.args
    lying = SimpleNamespace(args=dataclasses.replace(a, vocab_size=2 * a.vocab_size), state_dict=tiny.state_dict)
    g = write_gguf_model(lying, tmp_path / "vocab.gguf")  # metadata: twice the vocabulary of its embedding
    with pytest.raises(ModelFileError, match=re.escape(f"vocab.gguf: tensor 'token_embd.weight' has shape "
                                                       f"[{a.vocab_size}, {a.dim}], its metadata implies "
                                                       f"[{2 * a.vocab_size}, {a.dim}]")):
        resolve_model(str(g))
    hf = write_hf_model(tiny, tmp_path / "hf")
    assert resolve_model(str(hf)).args.hidden_dim == a.hidden_dim and load_tokenizer(resolve_model(str(hf)))
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": a.hidden_dim + 8}))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        resolve_model(str(hf))
    (hf / "config.json").write_text(json.dumps(cfg))
    st = hf / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="model.safetensors: not a safetensors file, or a truncated one"):
        resolve_model(str(hf))
    hf2 = write_hf_model(tiny, tmp_path / "hf2")
    (hf2 / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json: not a tokenizer the tokenizers library reads"):
        load_tokenizer(resolve_model(str(hf2)))
    (hf2 / "tokenizer.json").unlink()
    hf2 = write_hf_model(tiny, tmp_path / "hf2")
    (hf2 / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelFileError, match="config.json: not a text file"):
        resolve_model(str(hf2))
    deep = tmp_path / "deep.gguf"
    w = gguf.GGUFWriter(str(deep), "llama")
    nested: list = [1]
    for _ in range(12):
        nested = [nested]
    w.add_array("general.nested", nested)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="metadata arrays nested more than 8 deep"):
        resolve_model(str(deep))


def test_a_cluster_whose_gateway_cannot_read_the_tokenizer_exits_2_with_its_reason(tmp_path: Path) -> None:
    """The gateway node failed on the tokenizer, then its stop() joined threads that never
    started: the run said only "node n1 exited with code 1: RuntimeError: cannot join thread
    before it is started", exit 1. Now the node's own error, and the run's exit 2."""
    import yaml

    from tests.conftest import run_cli

    hf = write_hf_model(load_transformer("tiny"), tmp_path / "hf")
    (hf / "tokenizer.json").write_text("{not json")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({
        "model": str(hf), "draft": {"quant": "none"}, "speculation": {"mode": "off"},
        "nodes": [{"id": "n1", "device": "intel-nuc-13-i7", "zone": "z", "roles": ["prefill", "decode", "gateway"]}],
        "workload": {"prompts": ["hi"], "max_tokens": 2}}))
    r = run_cli("--cluster", str(cluster), timeout=180)
    assert r.returncode == 2, r.stderr[-1500:]
    last = r.stderr.strip().splitlines()[-1]
    assert "node n1 exited with code 2" in last and "not a tokenizer the tokenizers library reads" in last, last
    assert "cannot join thread" not in r.stderr


def test_model_metadata_out_of_range_is_a_model_file_error(tmp_path: Path) -> None:
    """The three readers of a model's shape (GGUF metadata, an HF config.json, a peer's index)
    checked it three ways: a GGUF head count of 0 was a ZeroDivisionError, an HF string or null
    size passed into the model. One check (shapes.checked_args) for all, naming the field."""
    import json

    import gguf

    from meshllm.engine.tensor_cache import args_from_wire, args_to_wire
    from meshllm.shapes import transformer_configs

    bad = tmp_path / "zero_heads.gguf"
    w = gguf.GGUFWriter(str(bad), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(0)
    w.add_vocab_size(320)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="n_heads must be a positive integer, got 0"):
        resolve_model(str(bad))
    hf = write_hf_model(load_transformer("tiny"), tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    for field, value, problem in (("hidden_size", "64", "dim must be a positive integer, got '64'"),
                                  ("rms_norm_eps", None, "norm_eps must be a positive number, got None"),
                                  ("num_attention_heads", 3, "dim/heads/kv_heads do not divide")):
        (hf / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ModelFileError, match=re.escape(problem)):
            resolve_model(str(hf))
    (hf / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match="expected a JSON object"):
        resolve_model(str(hf))
    wire = args_to_wire(transformer_configs["tiny"])
    assert args_from_wire(wire) == transformer_configs["tiny"]
    with pytest.raises(ValueError, match="args.n_kv_heads must be a positive integer"):
        args_from_wire({**wire, "n_kv_heads": 0})


def test_a_node_gives_freed_heap_back_once_it_holds_no_sequence() -> None:
    """roles/shard.py IdleTrim: glibc kept the heap freed by finished sequences (a demo decode node
    grew 959 -> 1389 MB resident over 480 requests in bursts, no KV held). The trim runs once per
    idle spell: not while sequences are held, not before TRIM_IDLE_S of holding none, not again
    until sequences were held since."""
    from meshllm.roles.shard import TRIM_IDLE_S, IdleTrim

    now = [0.0]
    trim = IdleTrim(clock=lambda: now[0])
    calls: list[float] = []
    trim.trim = lambda: calls.append(now[0])
    trim.tick(False)
    assert calls == []  # nothing held yet: nothing freed to give back
    for t in (1.0, 2.0, 3.0):  # busy
        now[0] = t
        trim.tick(True)
    now[0] = 3.0 + TRIM_IDLE_S / 2
    trim.tick(False)
    assert calls == []
    now[0] = 3.0 + TRIM_IDLE_S
    trim.tick(False)
    now[0] += 10
    trim.tick(False)
    assert calls == [3.0 + TRIM_IDLE_S] and trim.trims == 1
    trim.tick(True)
    now[0] += TRIM_IDLE_S
    trim.tick(False)
    assert len(calls) == 2
    # a prefill stage never holds a sequence at a tick: the rows it computed say it worked
    for work in (0, 512, 512):
        now[0] += TRIM_IDLE_S / 2
        trim.tick(False, work)
    assert len(calls) == 2  # half a spell since the last work
    now[0] += TRIM_IDLE_S / 2
    trim.tick(False, 512)
    assert len(calls) == 3
    IdleTrim().trim()  # the real one (malloc_trim where glibc has it) runs here


def test_a_stage_whose_range_moved_keeps_the_layers_it_held_and_loads_only_the_rest() -> None:
    """A re-plan that moves a stage's boundary by a few layers (a node died, or restarted and
    came back) read the stage's whole range again: a 4-stage replica's first node loaded 13
    layers for 5 s to take 3 more. Now the layers held are kept and only those around them are
    read, and the shard is the one a fresh load gives (same names, same tensors)."""
    from types import SimpleNamespace

    from meshllm.roles.shard import ShardHolder

    read: list[tuple[int, int]] = []

    class FileSource:  # the model file here (what MeshWeights.source gives then), recording each range read
        def source(self, a: int, b: int | None):
            read.append((a, b))
            return "smollm2-135m"

    shard = ShardHolder("n1", SimpleNamespace(model="smollm2-135m"), FileSource())
    whole = load_transformer("smollm2-135m")
    n = 30

    def same(a, b) -> bool:
        x, y = a.state_dict(), b.state_dict()
        return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)
    for layers, reads in [((10, 20), [(10, 20)]), ((8, 24), [(8, 10), (20, 24)]), ((0, 12), [(0, 8)]),
                          ((5, n), [(12, n)]), ((6, 9), []),  # carved: inside what is held
                          ((20, 25), [(20, 25)]),  # no overlap: read whole
                          ((0, n), [(0, n)])]:  # both ends to read (a tied head twice): read whole
        read.clear()
        got = shard.load(layers)
        assert read == reads, (layers, read)
        a, b = layers
        assert (got.start, got.end, got.has_embed, got.has_head) == (a, b, a == 0, b == n), layers
        assert len(got.layers) == b - a and all(same(mine, whole.layers[a + i]) for i, mine in enumerate(got.layers))
        assert (got.tok_embeddings is None) == (a > 0) and (a > 0 or same(got.tok_embeddings, whole.tok_embeddings))
        assert (got.output is None) == (b < n) and (b < n or same(got.output, whole.output) and same(got.norm,
                                                                                                    whole.norm))
    ids = [1, 504, 3458, 314, 4115, 314]
    assert torch.equal(logits_of(shard.model, ids), logits_of(whole, ids))


def test_a_load_asked_to_stop_stops_before_its_next_tensor_and_holds_nothing(tmp_path) -> None:
    """A node whose newer plan comes while it loads its part of an older one read the rest of that
    part to its end (minutes for a large shard on a slow disk). A load asks its `stop` before each
    tensor (GGUF and HF files, the draft a layer at a time) and stops at once: LoadCancelled.
    The shard holder then holds nothing (not the range it was asked for, nor the one it held
    before), and the next load is whole."""
    from types import SimpleNamespace

    from meshllm.engine.weights import load_quantized
    from meshllm.errors import LoadCancelled
    from meshllm.roles.shard import ShardHolder

    def after(n: int):
        asked = []

        def stop() -> bool:
            asked.append(1)
            return len(asked) > n
        return stop, asked
    hf = write_hf_model(load_transformer("tiny"), tmp_path / "hf")
    for spec, load in [("smollm2-135m", lambda st: load_transformer("smollm2-135m", 0, 30, stop=st)),
                       (str(hf), lambda st: load_transformer(str(hf), stop=st)),
                       ("smollm2-135m", lambda st: load_quantized("smollm2-135m", "w4a16", 64, stop=st))]:
        stop, asked = after(5)
        with pytest.raises(LoadCancelled):
            load(stop)
        assert len(asked) == 6, spec  # asked before each read: the sixth said stop, nothing more was read

    class FileSource:
        def source(self, a: int, b: int | None):
            return "smollm2-135m"

    shard = ShardHolder("n1", SimpleNamespace(model="smollm2-135m"), FileSource())
    shard.load((0, 10))
    for layers in [(20, 30), (5, 15)]:  # loaded whole; loaded around the layers held
        stop, _ = after(3)
        with pytest.raises(LoadCancelled):
            shard.load(layers, stop)
        assert shard.model is None and shard.key is None, layers
        got = shard.load(layers)
        assert (got.start, got.end) == layers and shard.key == ("smollm2-135m", layers)
        shard.load((0, 10))


def test_the_content_id_tells_a_file_with_other_weights_of_the_same_shape(tmp_path):
    """A copy of the embedded GGUF has its content id; one with a single norm tensor edited (a
    fine-tune's look-alike: same shape, same metadata, same header) has another. The id is what
    a PLAN carries, so a node on such a file refuses its part (tests/test_fuzz.py)."""
    import shutil

    from meshllm.engine.gguf_file import GGUFFile
    from meshllm.engine.sources import content_id, resolve_model

    src = resolve_model("smollm2-135m")
    same, edited = tmp_path / "same.gguf", tmp_path / "edited.gguf"
    shutil.copyfile(src.path, same)
    shutil.copyfile(src.path, edited)
    norm = GGUFFile(edited).tensors["blk.7.ffn_norm.weight"]
    with open(edited, "r+b") as f:  # one float in the middle of one layer's 576-float norm
        f.seek(norm.offset + norm.nbytes // 2)
        f.write(b"\x00\x00\xc0\x3f")
    ids = [content_id(resolve_model(str(p))) for p in (src.path, same, edited)]
    assert ids[0] == ids[1] != ids[2] and all(len(i) == 16 for i in ids)
    assert content_id(resolve_model("tiny")) is None  # random weights: no file

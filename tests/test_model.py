"""Oracle tests of the shard transformer and the KV cache (tiny random model and SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kvcache import KVCache, slot_capacity
from meshllm.engine.model import SeqSpan, Transformer
from meshllm.engine.weights import load_transformer
from meshllm.shapes import model_args

SPLITS_TINY = [(0, 1), (1, 3), (3, 4)]
SPLITS_SMOL = [(0, 7), (7, 19), (19, 30)]


def run_whole(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache()
    cache.allocate(0)
    return model(ids, [SeqSpan(0, 0, len(ids))], cache)


def run_chain(shards: list[Transformer], ids: torch.Tensor) -> torch.Tensor:
    x = ids
    for s in shards:
        cache = s.new_cache()
        cache.allocate(0)
        x = s(x, [SeqSpan(0, 0, len(ids))], cache)
    return x


@pytest.mark.parametrize("name,splits", [("tiny", SPLITS_TINY), ("tiny-untied", [(0, 2), (2, 5), (5, 6)])])
def test_shard_chain_equals_whole_tiny(name, splits):
    whole = load_transformer(name)
    shards = [load_transformer(name, a, b) for a, b in splits]
    assert [s.has_embed for s in shards] == [True, False, False]
    assert [s.has_head for s in shards] == [False, False, True]
    ids = torch.randint(0, whole.args.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(run_chain(shards, ids), run_whole(whole, ids), rtol=1e-5, atol=1e-5)


def test_shard_chain_equals_whole_smollm2(smollm2):
    shards = [load_transformer("smollm2-135m", a, b) for a, b in SPLITS_SMOL]
    ids = torch.tensor([504, 3575, 282, 4649, 314, 7042, 30, 198, 216, 33, 34])
    torch.testing.assert_close(run_chain(shards, ids), run_whole(smollm2, ids), rtol=1e-4, atol=1e-4)


def test_shard_loads_only_its_layers(monkeypatch):
    """A stage holding layers 10-20 must not dequantize (materialize) the other layers."""
    from meshllm.engine.gguf_file import GGUFFile

    touched = []
    orig = GGUFFile.dequantize
    monkeypatch.setattr(GGUFFile, "dequantize", lambda self, n: touched.append(n) or orig(self, n))
    shard = load_transformer("smollm2-135m", 10, 20)
    layers = {int(n.split(".")[1]) for n in touched if n.startswith("blk.")}
    assert layers == set(range(10, 20))
    assert not any(n.startswith(("token_embd", "output")) for n in touched)
    assert shard.tok_embeddings is None and shard.output is None
    assert len(shard.layers) == 10


def _ragged_check(model: Transformer, seed: int = 0) -> None:
    """Batch = seq A extends by 1 at pos 7, seq B by 5 at pos 3, seq C by 1 at pos 12, seq D prefill 4."""
    g = torch.Generator().manual_seed(seed)
    V = model.args.vocab_size
    history = {0: 7, 1: 3, 2: 12, 3: 0}
    new = {0: 1, 1: 5, 2: 1, 3: 4}
    toks = {s: torch.randint(0, V, (history[s] + new[s],), generator=g) for s in history}
    batched_cache, single_cache = model.new_cache(), model.new_cache()
    for s, n in history.items():
        for c in (batched_cache, single_cache):
            c.allocate(s)
            if n:
                model(toks[s][:n], [SeqSpan(s, 0, n)], c)
    spans = [SeqSpan(s, history[s], new[s]) for s in history]
    x = torch.cat([toks[s][history[s]:] for s in history])
    batched = model(x, spans, batched_cache)
    singles = torch.cat([model(toks[s][history[s]:], [SeqSpan(s, history[s], new[s])], single_cache)
                         for s in history])
    torch.testing.assert_close(batched, singles, rtol=1e-4, atol=1e-4)
    for s in history:
        assert batched_cache.length(s) == history[s] + new[s]


def test_ragged_batch_equals_per_sequence_tiny(tiny_model):
    _ragged_check(tiny_model)


def test_ragged_batch_equals_per_sequence_smollm2(smollm2):
    _ragged_check(smollm2, seed=3)


def test_no_cross_sequence_leak(tiny_model):
    """Changing another sequence's tokens must not change this sequence's logits at all."""
    m = tiny_model
    a = torch.tensor([5, 6, 7])
    outs = []
    for other in (torch.tensor([1, 2, 3, 4, 5]), torch.tensor([9, 9, 9, 9, 9])):
        c = m.new_cache()
        c.allocate(0)
        c.allocate(1)
        outs.append(m(torch.cat([a, other]), [SeqSpan(0, 0, 3), SeqSpan(1, 0, 5)], c)[:3])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_truncate_then_reextend_equals_fresh(smollm2):
    m = smollm2
    ids = torch.tensor([504, 3575, 282, 4649, 314, 7042, 30, 198])
    wrong = torch.tensor([11, 12, 13])
    c = m.new_cache()
    c.allocate(0)
    m(ids[:5], [SeqSpan(0, 0, 5)], c)
    m(wrong, [SeqSpan(0, 5, 3)], c)  # a rejected draft block
    c.truncate(0, 5)
    got = m(ids[5:], [SeqSpan(0, 5, 3)], c)
    want = run_whole(m, ids)[5:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        c.truncate(0, 99)


def test_export_import_continues_identically(smollm2):
    m = smollm2
    ids = torch.tensor([504, 3575, 282, 4649, 314, 7042, 30, 198, 216, 33])
    src = m.new_cache()
    src.allocate(7)
    m(ids[:6], [SeqSpan(7, 0, 6)], src)
    dst = m.new_cache()
    for a, b in [(0, 12), (12, 30)]:  # arrives in two parts, as from two prefill stages
        k, v = src.export(7, (a, b))
        assert k.shape == (b - a, 3, 6, 64)
        dst.import_seq(42, k.clone(), v.clone(), layer_start=a)
    assert dst.length(42) == 6
    got = m(ids[6:], [SeqSpan(42, 6, 4)], dst)
    want = m(ids[6:], [SeqSpan(7, 6, 4)], src)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_kv_cache_errors_are_specific(tiny_model):
    c = tiny_model.new_cache()
    with pytest.raises(KeyError, match="no KV slot"):
        c.length(3)
    c.allocate(3)
    with pytest.raises(KeyError, match="already"):
        c.allocate(3)
    with pytest.raises(ValueError, match="starts at 2"):
        tiny_model(torch.tensor([1]), [SeqSpan(3, 2, 1)], c)
    k = torch.zeros(2, 2, 5, 16)
    with pytest.raises(ValueError, match="not inside"):
        c.import_seq(9, k, k, layer_start=3)


def test_cache_grows_past_initial_capacity(tiny_model):
    m = tiny_model
    ids = torch.randint(0, m.args.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    c = m.new_cache()
    c.allocate(0, capacity=4)
    step = [m(ids[i:i + 30], [SeqSpan(0, i, 30)], c) for i in range(0, 150, 30)]
    torch.testing.assert_close(torch.cat(step), run_whole(m, ids), rtol=1e-4, atol=1e-4)


def test_a_slot_holds_its_ladder_capacity_whatever_path_it_grew_by():
    """A slot's capacity is `slot_capacity` of the positions it holds, however it got there (a
    whole prompt, chunks, one token at a time): the KV the leader charges a sequence for its
    longest context is what its slot can come to (roles/batcher.py kv_charge)."""
    c = KVCache(0, 2, 2, 4)
    for seq, chunks in ((0, [1200]), (1, [700, 300, 200]), (2, [1030] + [1] * 170)):
        c.allocate(seq, capacity=chunks[0])
        at = 0
        for n in chunks:
            for layer in (0, 1):
                c.write(layer, seq, at, torch.ones(n, 2, 4), torch.ones(n, 2, 4))
            c.commit([SeqSpan(seq, at, n)])
            at += n
        assert c.length(seq) == 1200 and c.export(seq)[0].shape[2] == 1200
    assert c.nbytes() == 3 * c.slot_bytes(1200) == 3 * 1536 * c.token_bytes()
    assert [slot_capacity(n) for n in (1, 64, 65, 600, 1024, 1025, 1536, 1537, 8192)] == \
        [64, 64, 128, 1024, 1024, 1536, 1536, 2048, 8192]


def test_registry_and_bad_ranges():
    assert model_args("smollm2-135m").n_layers == 30
    assert model_args("llama-2-70b").n_kv_heads == 8
    with pytest.raises(ValueError, match="known:"):
        model_args("gpt-5")
    with pytest.raises(ValueError, match="bad layer range"):
        Transformer(model_args("tiny"), 3, 2)


def _decode_steps(model: Transformer, lengths: list[int], steps: int, chunk: int = 0) -> list:
    """Logits of greedy one-token steps of len(lengths) sequences in one batch, each first
    prefilled with `lengths[i]` tokens into a slot of capacity 4 (so decoding grows it); with
    `chunk`, every step also carries `chunk` prompt tokens of one more sequence (a mixed batch)."""
    g = torch.Generator().manual_seed(5)
    cache, toks = model.new_cache(), []
    for s, n in enumerate(lengths):
        cache.allocate(s, capacity=4)
        ids = torch.randint(0, model.args.vocab_size, (n,), generator=g)
        toks.append(int(model(ids, [SeqSpan(s, 0, n)], cache)[-1].argmax()))
    extra = len(lengths)
    cache.allocate(extra, capacity=4)
    prompt = torch.randint(0, model.args.vocab_size, (steps * chunk,), generator=g)
    out = []
    for i in range(steps):
        spans = [SeqSpan(s, cache.length(s), 1) for s in range(len(lengths))]
        x = torch.tensor(toks)
        if chunk:  # the prompt chunk in the middle of the batch
            spans.insert(1, SeqSpan(extra, i * chunk, chunk))
            x = torch.cat([x[:1], prompt[i * chunk:(i + 1) * chunk], x[1:]])
        logits = model(x, spans, cache)
        out.append(logits)
        rows = [0] + list(range(1 + chunk, len(x))) if chunk else list(range(len(x)))
        toks = logits[rows].argmax(-1).tolist()
    return out


@pytest.mark.parametrize("chunk", [0, 5])
def test_one_token_rows_are_bit_identical_to_the_per_span_path(smollm2, monkeypatch, chunk):
    """One-token fp32 rows attend through their K/V slab (`KVCache.decode_slab`); that must give
    exactly the values of `attend`'s per-span path, for sequences of different lengths whose
    slots grow while decoding, alone and beside a prompt chunk in the same batch."""
    from meshllm.engine import model as model_mod

    fast = _decode_steps(smollm2, [3, 9, 17], 6, chunk)
    orig = model_mod.Transformer._context

    def per_span_context(self, spans, cache):
        ctx = orig(self, spans, cache)
        ctx.slabs = [None] * len(spans)
        return ctx

    monkeypatch.setattr(model_mod.Transformer, "_context", per_span_context)
    slow = _decode_steps(smollm2, [3, 9, 17], 6, chunk)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_a_batched_decode_step_costs_few_torch_calls_per_sequence(tiny_model):
    """Each more sequence in a decode batch adds a handful of torch calls per layer (batched
    decode must pay on CPU, where the per-call cost of tiny attention ops adds up): measured
    by counting the aten calls of one step of 1 and of 9 sequences."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def calls(n_seq: int) -> int:
        cache = tiny_model.new_cache()
        for s in range(n_seq):
            cache.allocate(s)
            tiny_model(torch.tensor([1, 2, 3]), [SeqSpan(s, 0, 3)], cache)
        Count.n = 0
        with Count():
            tiny_model(torch.tensor([4] * n_seq), [SeqSpan(s, 3, 1) for s in range(n_seq)], cache)
        return Count.n

    per_seq_layer = (calls(9) - calls(1)) / (8 * tiny_model.args.n_layers)
    assert per_seq_layer <= 20, per_seq_layer  # ~16 through the K/V slab, 27.4 with `attend` per span


def test_generate_allocates_kv_for_what_the_context_lets_it_generate(tiny_model, monkeypatch):
    """`--reference --max-tokens 1000000000` asked the allocator for 23 TB of KV cache (a
    RuntimeError): the cache is sized for the budget the context leaves."""
    from meshllm.engine.generate import GenerationOptions, generate

    asked = []
    real = KVCache.allocate
    monkeypatch.setattr(KVCache, "allocate", lambda self, slot, n, *a, **k: asked.append(n) or real(self, slot, n, *a, **k))
    r = generate(tiny_model, [1, 2, 3], GenerationOptions(max_tokens=10 ** 9))
    assert asked == [tiny_model.args.max_seq_len] and len(r.token_ids) == tiny_model.args.max_seq_len - 3


KERNEL_PROBE = """
import os, sys, torch
from meshllm.engine.model import SeqSpan
from meshllm.engine.weights import load_transformer
torch.set_num_threads(1)
m = load_transformer("smollm2-135m")
out = []
for n in (5, 23, 61, 5, 23, 61):  # each length again after the others (a tiny cache has dropped its kernels)
    cache = m.new_cache()
    cache.allocate(0, n + 2)
    out.append(m(torch.arange(100, 100 + n), [SeqSpan(0, 0, n)], cache))
torch.save({"sizes": [os.environ[v] for v in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")],
            "logits": out}, sys.argv[1])
"""


def test_the_kernel_cache_size_changes_no_output_and_is_set_before_torch_work(tmp_path):
    """oneDNN and ideep cached 1024 kernels each (a prefill node kept 311 MB over prompts of 120
    lengths: bench/prefill_memory.py); meshllm.engine sizes both caches before any torch work, and
    a kernel rebuilt after it left the cache gives the same bits: with caches of 2 (a rebuild at
    nearly every layer) the logits equal those of meshllm's size."""
    import os
    import subprocess
    import sys

    from meshllm.engine import KERNEL_CACHE_SIZE

    got = {}
    for name, env in (("meshllm", {}), ("tiny", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2", "LRU_CACHE_CAPACITY": "2"})):
        base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        subprocess.run([sys.executable, "-c", KERNEL_PROBE, str(tmp_path / name)], env={**base, **env}, check=True,
                       timeout=240)
        got[name] = torch.load(tmp_path / name)
    assert got["meshllm"]["sizes"] == [KERNEL_CACHE_SIZE] * 2 and got["tiny"]["sizes"] == ["2", "2"]
    for a, b in zip(got["meshllm"]["logits"], got["tiny"]["logits"]):
        assert torch.equal(a, b)

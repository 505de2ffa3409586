"""W4A16 / W8A16: the kernels against the dequantize-then-matmul oracle, storage size, draft quality."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from meshllm.engine.generate import GenerationOptions, generate
from meshllm.engine.quant import (
    HAS_INT4_KERNEL,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    linear_weight_bytes,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_nibbles,
)


def test_nibble_packing_roundtrip_and_layout():
    q = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    p = pack_nibbles(q)
    assert p.dtype == torch.uint8 and p.shape == (7, 5)  # two weights per byte
    assert torch.equal(unpack_nibbles(p), q)
    assert int(p[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)


def test_int4_quantization_error_is_bounded():
    w = torch.randn(64, 256)
    q = quantize_int4(w, 64)
    deq = dequantize_int4(q["packed"], q["scales"], q["mins"], 64)
    step = q["scales"].float().repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step * 0.5 + 1e-2).all()
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_int4(torch.randn(4, 96), 64)


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("shape,gs", [((1536, 576), 64), ((576, 1536), 128), ((192, 576), 64)])
def test_int4_kernel_matches_dequantized_reference(shape, gs):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.05
    q = quantize_int4(w, gs)
    fast = Int4Linear.from_quantized(q, gs, use_kernel=True)
    slow = Int4Linear.from_quantized(q, gs, use_kernel=False)
    assert fast.use_kernel and not slow.use_kernel
    x = torch.randn(5, shape[1], generator=g)
    y_fast, y_slow = fast(x), slow(x)
    rel = (y_fast - y_slow).abs().max() / y_slow.abs().max()
    assert rel < 2e-2, f"kernel vs reference relative error {rel:.4f}"


def test_int8_kernel_matches_reference():
    w = torch.randn(256, 128) * 0.1
    q = quantize_int8(w)
    mods = []
    for kern in (True, False):
        m = Int8Linear(128, 256, use_kernel=kern)
        m.weight, m.scales = q["weight"], q["scales"]
        mods.append(m)
    x = torch.randn(3, 128)
    rel = (mods[0](x) - mods[1](x)).abs().max() / mods[1](x).abs().max()
    assert rel < 2e-2


def test_draft_bytes_and_quality(smollm2, smollm2_tokenizer):
    draft = quantize_model(copy.deepcopy(smollm2), "w4a16", 64)
    ratio = linear_weight_bytes(draft) / linear_weight_bytes(smollm2)
    assert ratio <= 0.3, f"W4A16 linear weights use {ratio:.3f}x the fp32 bytes"
    assert all(b.dtype == torch.uint8 for n, b in draft.named_buffers() if n.endswith("packed"))
    prompt = smollm2_tokenizer.encode("The history of the Roman Empire begins with")
    opts = GenerationOptions(max_tokens=24)
    t = generate(smollm2, prompt, opts).token_ids
    # teacher-forced top-1 agreement of the draft on the target's own continuation
    from meshllm.engine.model import SeqSpan

    ids = torch.tensor(prompt + t)
    caches = [m.new_cache() for m in (smollm2, draft)]
    for c in caches:
        c.allocate(0)
    t_logits = smollm2(ids, [SeqSpan(0, 0, len(ids))], caches[0])
    d_logits = draft(ids, [SeqSpan(0, 0, len(ids))], caches[1])
    n = len(prompt) - 1
    agree = (t_logits[n:].argmax(-1) == d_logits[n:].argmax(-1)).float().mean().item()
    assert agree >= 0.5, f"draft top-1 agreement {agree:.2f}"
    assert (t_logits - d_logits).abs().max() > 0.1  # a real re-quantization, not a copy of the target


def test_w8_draft_runs(tiny_model):
    d = quantize_model(copy.deepcopy(tiny_model), "w8a16")
    c = d.new_cache()
    c.allocate(0)
    from meshllm.engine.model import SeqSpan

    out = d(torch.tensor([1, 2, 3]), [SeqSpan(0, 0, 3)], c)
    assert out.shape == (3, tiny_model.args.vocab_size) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="known: w4a16, w8a16"):
        quantize_model(copy.deepcopy(tiny_model), "w3")


def spy_on_loading(monkeypatch) -> tuple[list, list]:
    """(reads, slices) filled as weights.load_quantized runs: per whole-tensor read, (layers,
    the names of the other tensors read whole); per block of rows, (tensor name, rows)."""
    from meshllm.engine import weights

    reads, slices = [], []
    file_state, get_rows = weights._file_state, weights.FileRows.__getitem__

    def spy_state(src, start, end, embed, head, skip=(), stop=None):
        sd = file_state(src, start, end, embed, head, skip, stop)
        reads.append((end - start, sorted(k for k in sd if not k.startswith("layers."))))
        return sd

    def spy_rows(self, rows):
        t = get_rows(self, rows)
        slices.append((self.name, t.shape[0]))
        return t

    monkeypatch.setattr(weights, "_file_state", spy_state)
    monkeypatch.setattr(weights.FileRows, "__getitem__", spy_rows)
    return reads, slices


@pytest.mark.parametrize("quant", ["w4a16", "w8a16"])
def test_a_draft_built_a_layer_at_a_time_is_the_whole_targets_draft_bit_for_bit(smollm2, quant, monkeypatch):
    """Drafters and `--reference --draft` build the draft with weights.load_quantized: one layer's
    fp32 weights at a time (each quantized and freed before the next), the embedding and head a
    block of rows at a time, never the whole fp32 target (~32 GB for llama-3-8b, whose draft the
    planner puts on an 8 GB device). Same draft, bit for bit, as quantizing the whole target."""
    from meshllm.engine import weights
    from meshllm.engine.model import PackedLinear
    from meshllm.engine.quant import row_block

    reads, slices = spy_on_loading(monkeypatch)
    draft = weights.load_quantized("smollm2-135m", quant, 64)
    assert len(reads) == smollm2.args.n_layers + 2 and all(n <= 1 for n, _ in reads)
    assert [k for _, keys in reads for k in keys] == ["norm.weight"]  # embedding and head: by rows
    for name in ("token_embd.weight",):  # tied: the head is read from the embedding's tensor too
        blocks = [n for got, n in slices if got == name]
        assert len(blocks) >= 2 * 2 and max(blocks) <= row_block(smollm2.args.dim)
        assert sum(blocks) == 2 * smollm2.args.vocab_size
    assert not any(isinstance(m, PackedLinear) for m in draft.modules())
    got = draft.state_dict()
    want = quantize_model(copy.deepcopy(smollm2), quant, 64).state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("name, quant_name", [("tiny", "w4a16"), ("tiny-untied", "w8a16")])
def test_a_draft_of_an_hf_checkpoint_reads_its_embedding_and_head_by_rows(tmp_path, monkeypatch, name, quant_name):
    """An HF (safetensors) target's draft is built the same way as a GGUF one's: its embedding
    and LM head (2.1 GB each in fp32 for llama-3-8b) are read a block of rows at a time, not
    whole, and the draft is the whole target's, bit for bit (a tied head: read from the
    embedding's tensor)."""
    from meshllm.engine import quant, weights
    from meshllm.engine.weights import load_transformer
    from tests.conftest import write_hf_model

    ref = load_transformer(name)
    d = write_hf_model(ref, tmp_path / "hf")
    monkeypatch.setattr(quant, "ROW_BLOCK", 64 * ref.args.dim)  # blocks of 64 rows
    reads, slices = spy_on_loading(monkeypatch)
    draft = weights.load_quantized(str(d), quant_name, 16)
    assert [k for _, keys in reads for k in keys] == ["norm.weight"]  # the embedding and head: by rows only
    head = "model.embed_tokens.weight" if ref.args.tie_embeddings else "lm_head.weight"
    for key in {"model.embed_tokens.weight", head}:
        blocks = [n for got, n in slices if got == key]
        uses = 2 if key == head == "model.embed_tokens.weight" else 1
        assert len(blocks) >= 2 * uses and max(blocks) <= 64 and sum(blocks) == uses * ref.args.vocab_size
    want = quantize_model(load_transformer(str(d), pack=False), quant_name, 16).state_dict()
    got = draft.state_dict()
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_quantizing_by_blocks_of_rows_is_the_same_as_whole(monkeypatch):
    """quant.by_rows: quantizing (and packing for the int4 kernel) a block of rows at a time keeps
    the temporaries small and changes no bit; row slices of a GGUF tensor dequantize to the same
    rows as the whole tensor."""
    from meshllm.engine import quant
    from meshllm.engine.weights import embedded_gguf_path, gguf_reader

    g = torch.Generator().manual_seed(3)
    w = torch.randn(1040, 256, generator=g)
    whole4, whole8 = quantize_int4(w, 64), quantize_int8(w)
    kernel = Int4Linear.from_quantized(whole4, 64, use_kernel=HAS_INT4_KERNEL)
    monkeypatch.setattr(quant, "ROW_BLOCK", 64 * 256)  # 17 blocks, the last of 16 rows
    assert quant.row_block(256) == 64
    for got, want in ((quantize_int4(w, 64), whole4), (quantize_int8(w), whole8)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    blocked = Int4Linear.from_quantized(whole4, 64, use_kernel=HAS_INT4_KERNEL)
    assert all(torch.equal(a, b) for a, b in zip(blocked.buffers(), kernel.buffers()))
    reader = gguf_reader(embedded_gguf_path())
    for name in ("token_embd.weight", "blk.0.ffn_down.weight"):  # Q8_0, Q4_1
        rows = reader.tensors[name].shape[0]
        a, b = rows // 3, rows // 3 + 100
        assert np.array_equal(reader.dequantize(name, (a, b)), reader.dequantize(name)[a:b])
    with pytest.raises(ValueError, match="1-D"):
        reader.dequantize("blk.0.attn_norm.weight", (0, 10))

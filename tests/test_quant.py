"""W4A16 / W8A16: the kernels against the dequantize-then-matmul oracle, storage size, draft quality."""

from __future__ import annotations

import copy

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


def test_a_draft_quantized_from_unpacked_weights_is_the_same_bit_for_bit(smollm2):
    """Drafters load the target with pack=False (packing every linear for oneDNN first was ~0.85 s
    of a drafter's start): the quantized draft must not change by a bit."""
    from meshllm.engine.model import PackedLinear
    from meshllm.engine.weights import load_transformer

    unpacked = load_transformer("smollm2-135m", pack=False)
    assert not any(isinstance(m, PackedLinear) for m in unpacked.modules())
    got = quantize_model(unpacked, "w4a16", 64).state_dict()
    want = quantize_model(copy.deepcopy(smollm2), "w4a16", 64).state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

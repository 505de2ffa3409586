"""Cost model: bytes and FLOPs from published model shapes; roofline and link formulas."""

from __future__ import annotations

import pytest

from meshllm.device import DeviceProfile
from meshllm.partition.cost import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    decode_time_s,
    link_time_s,
    model_costs,
    path_mbps,
    prefill_time_s,
    stage_batch_s,
    stage_decode_s,
    stage_prefill_s,
)
from meshllm.shapes import model_args

DEV = DeviceProfile("d", memory_gb=24, compute_tflops=100, memory_bandwidth_gbps=1000, network_mbps=1000)


@pytest.mark.parametrize("name,params_b", [("llama-2-7b", 6.74), ("llama-3-8b", 8.03), ("llama-2-70b", 68.98)])
def test_weight_bytes_match_published_parameter_counts(name, params_b):
    mc = model_costs(model_args(name), "fp16")
    assert mc.weight_bytes == pytest.approx(2 * params_b * 1e9, rel=0.02)


def test_kv_bytes_per_token_llama3_8b():
    mc = model_costs(model_args("llama-3-8b"))
    assert mc.kv_bytes_per_token * mc.n_layers == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert mc.act_bytes_per_token == 4096 * 2


def test_dtype_scales_weights():
    a = model_args("llama-2-7b")
    fp16, int8, int4 = (model_costs(a, d).layer_bytes for d in ("fp16", "int8", "int4"))
    assert int8 == pytest.approx(fp16 / 2, rel=0.01) and 3.4 < fp16 / int4 < 3.6
    with pytest.raises(ValueError, match="known"):
        model_costs(a, "fp8")


def test_prefill_is_compute_bound_for_long_prompts():
    a = model_args("llama-2-7b")
    mc = model_costs(a)
    t = prefill_time_s(a, DEV, 32, 512)
    flops = 512 * 32 * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * 256)
    assert t == pytest.approx(flops / (DEV.compute_tflops * 1e12 * COMPUTE_EFFICIENCY))


def test_decode_roofline_memory_bound_at_batch_1_compute_bound_at_large_batch():
    a = model_args("llama-2-7b")
    mc = model_costs(a)
    t1 = decode_time_s(a, DEV, 32, 1, 100)
    weights = 32 * mc.layer_bytes
    assert t1 == pytest.approx((weights + 100 * 32 * mc.kv_bytes_per_token) / (1000e9 * 0.7))
    times = [stage_decode_s(mc, DEV, 32, b, 100) for b in (1, 2, 8, 64, 512, 4096)]
    assert times == sorted(times)
    assert times[-1] / times[-2] == pytest.approx(8, rel=0.05)  # compute-bound: linear in batch


def test_link_time_and_path_bandwidth():
    assert link_time_s(1e6, rtt_ms=10, bandwidth_mbps=8) == pytest.approx(0.005 + 1.0)
    slow = DeviceProfile("s", 1, 1, 1, network_mbps=100)
    assert path_mbps(DEV, slow, None) == 100
    assert path_mbps(DEV, DEV, 50) == 50


def test_stage_batch_time_matches_prefill_and_decode_formulas():
    """One formula: the Pacer's ragged-batch time reduces to the planner's prefill and decode times."""

    mc = model_costs(model_args("llama-3-8b"), "fp16")
    dev = DeviceProfile("d", 16, 10.0, 100.0, 1000)
    assert stage_batch_s(mc, dev, 8, [(512, 512)], last=True, logit_rows=1) == pytest.approx(
        stage_prefill_s(mc, dev, 8, 512, last=True), rel=0.02)
    assert stage_batch_s(mc, dev, 8, [(1, 300)] * 4, last=True, logit_rows=4) == pytest.approx(
        stage_decode_s(mc, dev, 8, 4, 300, last=True), rel=0.02)
    assert stage_batch_s(mc, dev, 8, [(1, 300)] * 8) > stage_batch_s(mc, dev, 8, [(1, 300)] * 4)


def test_pipeline_columns_cost_each_stage_exactly_as_the_per_stage_formulas():
    """steps.py costs a pipeline's stages as numpy columns (one cached entry per pipeline);
    every figure equals cost.py's per-stage formula for that device, bit for bit."""
    import math
    import random

    from meshllm.device import load_device
    from meshllm.partition.cost import decode_work, flops_per_s, prefill_work, transfer_s
    from meshllm.partition.dp import Member, Net
    from meshllm.partition.replica import (
        MAX_DECODE_BATCH,
        Mix,
        decode_concurrency,
        mixed_compute_req_s,
        port_s,
    )
    from meshllm.partition.steps import prefill_stage_s

    mc, mix = model_costs(model_args("llama-3-8b")), Mix(700, 150)
    net = Net({frozenset(("a", "b")): (30.0, 200.0)})
    names = ["desktop-rtx-4090", "desktop-rtx-3060-12gb", "jetson-agx-orin-64gb", "mac-mini-m2", "intel-nuc-13-i7"]
    rng = random.Random(4)
    for _ in range(40):
        k = rng.randint(1, 6)
        seq = [Member(f"m{i}", load_device(rng.choice(names)), rng.choice("ab")) for i in range(k)]
        counts = [rng.randint(1, 8) for _ in range(k)]
        tokens = rng.choice([1.0, 57.0, 700.0])
        stages, hops = prefill_stage_s(mc, seq, counts, net, tokens)
        assert stages == [float(stage_prefill_s(mc, m.device, n, tokens, i == k - 1))
                          for i, (m, n) in enumerate(zip(seq, counts))]
        assert hops == [net.hop_s(a, b, tokens * mc.act_bytes_per_token) for a, b in zip(seq, seq[1:])]
        want_port = 0.0
        for i, (m, n) in enumerate(zip(seq, counts)):
            act = tokens * mc.act_bytes_per_token
            tx = act * (i < k - 1) + 3.0 * n * mc.kv_bytes_per_token
            rx = act * (i > 0) + 5.0 * n * mc.kv_bytes_per_token
            want_port = max(want_port, transfer_s(max(tx, rx), m.device.network_mbps))
        assert port_s(mc, seq, counts, tokens, 3.0, 5.0) == want_port
        want_seqs = MAX_DECODE_BATCH
        for i, (m, n) in enumerate(zip(seq, counts)):
            free = m.device.memory_bytes - mc.stage_weight_bytes(n, i == 0, i == k - 1)
            want_seqs = min(want_seqs, math.floor(free / (n * mc.kv_bytes_per_token * (mix.mean_in + mix.mean_out))))
        assert decode_concurrency(mc, seq, counts, mix) == max(0, want_seqs)
        worst = max((prefill_work(mc, n, mix.mean_in, i == k - 1)[0]
                     + decode_work(mc, n, mix.mean_out - 1, mix.decode_ctx, i == k - 1)[0]) / flops_per_s(m.device)
                    for i, (m, n) in enumerate(zip(seq, counts)))
        assert mixed_compute_req_s(mc, seq, counts, mix) == 1.0 / worst


def test_a_step_of_one_chunk_size_costs_bit_for_bit_what_the_numpy_columns_give():
    """fused_step_s costs a scalar chunk stage by stage in plain floats (the simulator's hot path);
    it must give exactly the numpy columns' seconds, pipelines of 8 stages or more included
    (numpy sums those pairwise, in eight accumulators), with or without a chunk riding along."""
    import math
    import random

    import numpy as np

    from meshllm.device import load_device
    from meshllm.partition.dp import Member, Net
    from meshllm.partition.steps import _array_step_s, fused_step_s, numpy_sum, pipe_arrays

    mc = model_costs(model_args("llama-2-70b"))
    net = Net({frozenset(("a", "b")): (30.0, 200.0), frozenset(("b", "c")): (80.0, 50.0)})
    names = ["desktop-rtx-4090", "desktop-rtx-3060-12gb", "jetson-orin-nano-8gb", "mac-mini-m2", "raspberry-pi-5-8gb"]
    rng = random.Random(7)
    for _ in range(600):
        k = rng.choice([1, 2, 3, rng.randint(4, 40)])
        seq = [Member(f"m{i}", load_device(rng.choice(names)), rng.choice("abc")) for i in range(k)]
        counts = [rng.randint(1, 4) for _ in range(k)]
        batch = rng.choice([rng.randint(1, 256), 0.5 + 40 * rng.random()])
        context = 3000 * rng.random()
        chunk = rng.choice([0, rng.randint(1, 4096)])
        chunk_ctx = chunk + 2000 * rng.random() if chunk else 0.0
        prompts = rng.randint(0, 4) if chunk else 0
        micro = max(1, min(k, math.ceil(batch) + prompts))
        want = _array_step_s(mc, pipe_arrays(seq, counts), seq, net, batch, context, chunk, chunk_ctx, micro)
        assert fused_step_s(mc, seq, counts, net, batch, context, chunk, chunk_ctx, prompts) == want
    for n in (0, 1, 7, 8, 9, 17, 64, 130, 300):
        xs = [rng.random() * 10 ** rng.randint(-6, 3) for _ in range(n)]
        assert numpy_sum(xs) == float(np.array(xs).reshape(n, 1).sum(axis=0)[0])


def test_model_costs_figures_and_stage_weights_are_exact():
    """llama-3-8b at fp16, to the byte and FLOP: a layer's two RMSNorm vectors, the final norm
    with the head, QK^T + AV at 4 FLOPs per position and model dim, and the embedding on the
    first stage only, the head on the last only."""
    mc = model_costs(model_args("llama-3-8b"), "fp16")
    layer_params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert mc.layer_flops_per_token == 2 * layer_params
    assert mc.layer_bytes == 2 * layer_params + 2 * 4096 * 2
    assert mc.attn_flops_per_token_ctx == 4 * 4096
    assert mc.embed_bytes == 128256 * 4096 * 2 and mc.head_bytes == mc.embed_bytes + 4096 * 2
    assert mc.head_flops_per_token == 2 * 128256 * 4096
    assert mc.stage_weight_bytes(3, True, False) == 3 * mc.layer_bytes + mc.embed_bytes
    assert mc.stage_weight_bytes(3, False, True) == 3 * mc.layer_bytes + mc.head_bytes
    assert mc.stage_weight_bytes(32, True, True) == mc.weight_bytes


def test_the_lm_head_runs_on_the_last_stage_and_a_request_s_flops_add_up():
    """Prefill on the last stage adds the head once (the first output token) and reads its
    weights; a ragged batch adds it per logit row on the last stage only; a request's FLOPs are its prefill and n_out - 1
    decode steps at their mean context n_in + n_out / 2."""
    from meshllm.partition.cost import decode_work, prefill_work, request_flops

    mc = model_costs(model_args("llama-3-8b"), "fp16")
    head = mc.head_flops_per_token
    assert prefill_work(mc, 4, 100, last=True)[0] - prefill_work(mc, 4, 100)[0] == pytest.approx(head)
    assert prefill_work(mc, 4, 100, last=True)[1] - prefill_work(mc, 4, 100)[1] == pytest.approx(mc.head_bytes)
    slow = DeviceProfile("s", 16, 0.001, 1e6, 1000)  # compute-bound: seconds are FLOPs / FLOP/s
    mid = stage_batch_s(mc, slow, 4, [(1, 300)] * 4, last=False, logit_rows=4)
    assert mid == pytest.approx(stage_batch_s(mc, slow, 4, [(1, 300)] * 4), rel=1e-12)
    last = stage_batch_s(mc, slow, 4, [(1, 300)] * 4, last=True, logit_rows=4)
    assert last - mid == pytest.approx(4 * head / (slow.compute_tflops * 1e12 * COMPUTE_EFFICIENCY), rel=1e-9)
    fast = DeviceProfile("f", 16, 1e6, 1.0, 1000)  # memory-bound: seconds are bytes / bytes/s
    first = stage_batch_s(mc, fast, 4, [(1, 300)], first=True) - stage_batch_s(mc, fast, 4, [(1, 300)])
    assert first == pytest.approx(mc.embed_bytes / (1e9 * BANDWIDTH_EFFICIENCY), rel=1e-9)  # the embedding
    L = mc.n_layers
    assert request_flops(mc, 100, 1) == pytest.approx(prefill_work(mc, L, 100, True)[0])
    want = prefill_work(mc, L, 100, True)[0] + decode_work(mc, L, 10, 105.5, True)[0]
    assert request_flops(mc, 100, 11) == pytest.approx(want, rel=1e-12)


def test_a_pipeline_s_occupancy_is_its_slowest_stage_or_link():
    """A link slower than every stage sets how often a new item may enter; the latency is
    every stage and link in turn."""
    from meshllm.partition.cost import pipeline_s

    assert pipeline_s([1.0, 2.0], [5.0]) == (5.0, 8.0)
    assert pipeline_s([1.0, 2.0], [0.5]) == (2.0, 3.5)
    assert pipeline_s([3.0], []) == (3.0, 3.0)

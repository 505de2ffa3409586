"""`--plan`: a valid plan (README schema) for every cluster file; impossible clusters exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshllm.config import load_cluster, parse_cluster, plan_inputs
from meshllm.partition.plan import Plan, PlanError, PlanInfeasible, check_cover, plan_cluster
from meshllm.shapes import model_args
from tests.conftest import REPO, run_cli

CLUSTERS = sorted(p for p in (REPO / "clusters").glob("*.yaml") if p.name != "impossible.yaml")


def check_schema(obj: dict, cfg) -> None:
    assert {"replicas", "drafters", "unused", "planner_s"} <= set(obj)
    ids = {n.id for n in cfg.nodes}
    n_layers = model_args(cfg.model).n_layers
    seen = []
    for r in obj["replicas"]:
        assert set(r) == {"id", "role", "stages", "predicted"} and r["role"] in ("prefill", "decode", "mixed")
        assert set(r["predicted"]) == {"prefill_tok_s", "decode_tok_s", "bottleneck_ms"}
        assert all(v > 0 for v in r["predicted"].values())
        check_cover(r["id"], [tuple(s["layers"]) for s in r["stages"]], n_layers)
        seen += [s["node"] for s in r["stages"]]
    everyone = seen + obj["drafters"] + obj["unused"]
    assert sorted(everyone) == sorted(ids), "every node exactly once"
    assert isinstance(obj["planner_s"], float)
    assert Plan.from_json(json.loads(json.dumps(obj))).to_json() == obj, "the PLAN message round-trips"


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_cluster_file_plans(path):
    cfg = load_cluster(path)
    plan = plan_cluster(plan_inputs(cfg), log=False)
    check_schema(plan.to_json(), cfg)
    assert plan.replicas and plan.describe().startswith("plan for")


def test_plan_cli_json_and_png(tmp_path):
    png = tmp_path / "plan.png"
    p = run_cli("--plan", "clusters/demo.yaml", "--json", "--png", str(png))
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    check_schema(obj, load_cluster(REPO / "clusters/demo.yaml"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drafter_only = {n.id for n in load_cluster(REPO / "clusters/demo.yaml").nodes if n.roles == ("drafter",)}
    assert drafter_only and drafter_only <= set(obj["drafters"]) | set(obj["unused"])  # roles: [drafter]
    assert set(obj["unused"]) <= set(obj["unused_reasons"])  # every unused node says why


def test_plan_rate_plans_for_that_load_and_other_modes_refuse_it():
    """`--plan --rate R`: the plan is made for R req/s instead of the file's load (the latency at
    the rate is the search's objective), and its prediction is at R; a rate that is not > 0 is
    exit 2, and so is --rate with a mode that does not plan (a cluster's load is its workload)."""
    from dataclasses import replace

    path = REPO / "clusters" / "bench-edge-8b.yaml"
    r = run_cli("--plan", str(path), "--rate", "12.5", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["prediction"]["rate_per_s"] == 12.5
    want = plan_cluster(replace(plan_inputs(load_cluster(path)), rate_per_s=12.5), seed=0, log=False)
    assert [(x["role"], [s["node"] for s in x["stages"]]) for x in obj["replicas"]] == \
        [(x.role, [s.node for s in x.stages]) for x in want.replicas]
    assert json.loads(run_cli("--plan", str(path), "--json").stdout)["prediction"]["rate_per_s"] == 1.0
    for bad in ("0", "-1", "nan", "1e-300", "1e308"):  # (1e-300: waits of 0 by float absorption; 1e308: 300 digits)
        r = run_cli("--plan", str(path), f"--rate={bad}")
        assert r.returncode == 2 and "--rate must be a number of requests per second in [1e-09, 1e+06]" in r.stderr
    r = run_cli("--cluster", "clusters/demo.yaml", "--rate", "2")
    assert r.returncode == 2 and "--rate applies to --plan and --simulate only" in r.stderr
    tiny = json.loads(run_cli("--plan", "clusters/demo.yaml", "--rate", "1e-9", "--json").stdout)
    assert tiny["prediction"]["rate_per_s"] == 1e-9  # 6 decimals printed 0.0


def test_figures_below_a_thousandth_keep_four_significant_digits():
    from meshllm.partition.plan import rounded

    assert rounded(1.23456e-9, 6) == 1.235e-9 and rounded(0.0012345678, 6) == 0.001235
    assert rounded(12.3456789, 6) == 12.345679 and rounded(0.0, 6) == 0.0 and rounded(float("inf"), 6) == float("inf")
    plan = Plan("m", 1, "fp32", (), (), (), 0.1, 4.2e-9)
    assert plan.to_json()["capacity_req_s"] == 4.2e-9


@pytest.mark.parametrize("mode", ["--plan", "--simulate"])
def test_impossible_cluster_exits_2_naming_the_shortfall(mode):
    """--simulate reported the policies that could not run (all null, exit 0; memory-ring's
    impossible ring with figures) where --plan exits 2: both now name the shortfall."""
    p = run_cli(mode, "clusters/impossible.yaml", "--json")
    assert p.returncode == 2 and p.stdout == ""
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "impossible.yaml" in line and "GB short" in line and "pi-1" in line


def test_roles_limit_assignment():
    cfg = load_cluster(REPO / "clusters/failure.yaml")
    plan = plan_cluster(plan_inputs(cfg), log=False)
    role_of = {s.node: r.role for r in plan.replicas for s in r.stages}
    assert role_of.get("fog-1", "prefill") == "prefill"
    assert role_of.get("fog-2", "decode") == "decode" and role_of.get("fog-3", "decode") == "decode"
    assert {"edge-1", "edge-2"} <= set(plan.drafters)


def test_a_drafter_only_node_that_does_not_draft_says_why():
    """`roles: [drafter]` nodes left out said only "its roles (drafter) allow no stage", which
    names roles that do allow drafting: the draft did not fit in their memory, or speculation
    was off."""
    nodes = [{"id": "e1", "device": "raspberry-pi-5-8gb", "zone": "edge", "roles": ["drafter"]},
             {"id": "e2", "device": "raspberry-pi-4-4gb", "zone": "edge", "roles": ["drafter"]},
             {"id": "box", "device": "cloud-a100-80gb", "zone": "dc"}]
    doc = {"model": "llama-3-8b", "nodes": nodes, "links": [{"zones": ["edge", "dc"], "rtt_ms": 40, "bandwidth_mbps": 20}]}
    plan = plan_cluster(plan_inputs(parse_cluster(doc, "c.yaml")), log=False)
    assert plan.drafters == ("e1",) and plan.reasons["e1"] == "drafter; its roles (drafter) allow no stage"
    assert plan.reasons["e2"].startswith("its roles (drafter) allow no stage, and no draft: its memory (3.20 GB) "
                                         "cannot hold the draft while it builds it (5."), plan.reasons["e2"]
    off = plan_cluster(plan_inputs(parse_cluster({**doc, "speculation": {"mode": "off"}}, "c.yaml")), log=False)
    assert off.drafters == () and off.reasons["e1"].endswith("no draft: speculation is off (no draft to serve)")


def test_a_device_that_barely_computes_forms_no_replica_and_says_why():
    """A profile of 1e-6 TFLOP/s (a typo, or a box that is mostly busy) holds the whole model, so
    the search once made it a prefill replica with a 15-hour step beside two NUCs: a replica the
    router would never use, holding the device from drafting. It adds under MIN_REPLICA_SHARE of
    the capacity, so it forms none and drafts; alone, it is still a plan."""
    from meshllm.partition.grouping import MIN_REPLICA_SHARE

    slow = {"memory_gb": 16, "compute_tflops": 1e-6, "memory_bandwidth_gbps": 0.001, "network_mbps": 1000}
    nodes = [{"id": "a", "device": "intel-nuc-13-i7", "zone": "z"}, {"id": "b", "device": "intel-nuc-13-i7", "zone": "z"},
             {"id": "slow", "device": slow, "zone": "z"}]
    work = {"arrival_rate_per_s": 5, "input_tokens": {"mean": 128}, "output_tokens": {"mean": 32}}
    plan = plan_cluster(plan_inputs(parse_cluster({"model": "smollm2-135m", "nodes": nodes, "workload": work},
                                                  "slow.yaml")), log=False)
    without = plan_cluster(plan_inputs(parse_cluster({"model": "smollm2-135m", "nodes": nodes[:2], "workload": work},
                                                     "two.yaml")), log=False)
    assert plan.replica_of("slow") is None and "slow" in plan.drafters
    assert plan.capacity_req_s == pytest.approx(without.capacity_req_s, rel=MIN_REPLICA_SHARE)
    assert f"under {100 * MIN_REPLICA_SHARE:g} % of what the replicas serve" in plan.reasons["slow"]
    alone = plan_cluster(plan_inputs(parse_cluster({"model": "smollm2-135m", "nodes": nodes[2:]}, "one.yaml")),
                         log=False)
    assert [s.node for r in alone.replicas for s in r.stages] == ["slow"]
    # a replica whose role the nodes' roles: force is formed all the same: here the only prefill one
    forced = [{**nodes[0], "roles": ["decode"]}, {**nodes[2], "roles": ["prefill"]}]
    asked = plan_cluster(plan_inputs(parse_cluster({"model": "smollm2-135m", "nodes": forced}, "forced.yaml")),
                         log=False)
    assert {(s.node, str(r.role)) for r in asked.replicas for s in r.stages} == {("a", "decode"), ("slow", "prefill")}


def test_a_tiny_replica_that_is_its_roles_whole_pool_is_still_formed():
    """The one node `roles:` let prefill is the grouping's bottleneck however slow: dropping it as
    negligible left the NUCs no prefill at all (capacity 0), so one NUC sat unused."""
    slow = {"memory_gb": 16, "compute_tflops": 1e-4, "memory_bandwidth_gbps": 0.1, "network_mbps": 1000}
    nodes = [{"id": "a", "device": "intel-nuc-13-i7", "zone": "z", "roles": ["decode"]},
             {"id": "b", "device": "intel-nuc-13-i7", "zone": "z", "roles": ["decode"]},
             {"id": "slow", "device": slow, "zone": "z", "roles": ["prefill"]}]
    work = {"arrival_rate_per_s": 0, "input_tokens": {"mean": 128}, "output_tokens": {"mean": 32}}
    plan = plan_cluster(plan_inputs(parse_cluster({"model": "smollm2-135m", "nodes": nodes, "workload": work},
                                                  "forced.yaml")), log=False)
    assert sorted(s.node for r in plan.replicas for s in r.stages) == ["a", "b", "slow"]


def test_many_negligible_replicas_are_dropped_only_up_to_the_share_in_all():
    from meshllm.partition.grouping import MIN_REPLICA_SHARE, droppable

    rates = [(1.0, 1.0, 1.0)] + [(0.9e-4, 0.9e-4, 0.9e-4)] * 300  # each under the share, 2.6 % together
    drop = droppable(rates)
    assert sum(max(rates[k]) for k in drop) < MIN_REPLICA_SHARE * sum(max(r) for r in rates)
    assert len(drop) == 1


def test_only_drafters_is_infeasible():
    data = {"model": "smollm2-135m", "nodes": [{"id": "a", "device": "raspberry-pi-5-8gb", "zone": "e",
                                                "roles": ["drafter"]}]}
    with pytest.raises(PlanInfeasible, match="no node may hold a stage"):
        plan_cluster(plan_inputs(parse_cluster(data, "inline.yaml")), log=False)


@pytest.mark.parametrize("only, missing", [("decode", "prefill"), ("prefill", "decode")])
def test_nodes_that_may_only_decode_or_only_prefill_are_named_as_the_shortfall(only, missing):
    """A lone node limited to [decode] exited 2 with "no replica reaches a positive request rate"."""
    data = {"model": "smollm2-135m", "nodes": [{"id": "a", "device": "intel-nuc-13-i7", "zone": "z", "roles": [only]}]}
    with pytest.raises(PlanInfeasible, match=f"no node may {missing} .*allow only {only}"):
        plan_cluster(plan_inputs(parse_cluster(data, "inline.yaml")), log=False)


def test_a_cluster_whose_roles_leave_a_phase_without_the_model_exits_2_for_plan_and_simulate(tmp_path):
    """--simulate exited 0 with every policy null where --plan exited 2 (roles that allow no node
    to decode); a prefill-only RTX 4090 beside a decode-only Pi 3B was "memory too fragmented"
    where no node that may decode holds the model."""
    nuc = {"device": "intel-nuc-13-i7", "zone": "z", "roles": ["prefill"]}
    for nodes, model, why in [
            ([{"id": "a", **nuc}, {"id": "b", **nuc}], "smollm2-135m",
             "no node may decode (the stage-capable nodes' roles allow only prefill)"),
            ([{"id": "a", "device": "desktop-rtx-4090", "zone": "z", "roles": ["prefill"]},
              {"id": "b", "device": "raspberry-pi-3b-1gb", "zone": "z", "roles": ["decode"]}], "llama-2-7b",
             "the nodes that may decode cannot hold the model together: devices b have 0.60 GB")]:
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({"model": model, "nodes": nodes}))
        for cmd in ("--plan", "--simulate"):
            r = run_cli(cmd, str(path))
            assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_a_rate_above_capacity_predicts_null_waits_in_valid_json(tmp_path):
    """--plan --json printed `Infinity` (not JSON: a strict parser refuses it) for the waits of
    a plan whose workload rate is above its capacity; now null, and a plan read back from JSON
    (a PLAN from the network) takes null as unbounded."""
    path = tmp_path / "over.yaml"
    path.write_text(json.dumps({"model": "llama-3-8b", "workload": {"arrival_rate_per_s": 1000},
                                "nodes": [{"id": n, "device": "desktop-rtx-4090", "zone": "z"} for n in "ab"]}))
    r = run_cli("--plan", str(path), "--json")
    assert r.returncode == 0, r.stderr

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    obj = json.loads(r.stdout, parse_constant=refuse)
    assert obj["prediction"] == {"rate_per_s": 1000.0, "mean_wait_ms": None, "mean_ttft_ms": None,
                                 "mean_e2e_ms": None}
    back = Plan.from_json(obj)
    assert back.prediction["mean_wait_ms"] == float("inf") and back.to_json()["prediction"] == obj["prediction"]
    assert "above the plan's capacity, waits grow without bound" in run_cli("--plan", str(path)).stdout


def test_weights_dtype_changes_the_plan():
    base = {"model": "llama-3-8b", "nodes": [{"id": f"n{i}", "device": "jetson-orin-nano-8gb", "zone": "f"}
                                             for i in range(2)]}
    with pytest.raises(PlanInfeasible):  # 16 GB of fp16 weights do not fit 2 x 6.5 GB
        plan_cluster(plan_inputs(parse_cluster(base, "fp16.yaml")), log=False)
    plan = plan_cluster(plan_inputs(parse_cluster({**base, "weights_dtype": "int4"}, "int4.yaml")), log=False)
    assert plan.dtype == "int4" and plan.replicas


def test_a_plan_from_the_network_with_an_unknown_dtype_is_a_plan_error():
    """Found by fuzzing PLAN: a dtype outside WEIGHT_DTYPES reached the stage's KV sizing as a
    ValueError deep inside the host."""
    obj = Plan("tiny", 4, "fp32", (), (), (), 0.0, 1.0).to_json()
    assert Plan.from_json(obj).dtype == "fp32"
    with pytest.raises(PlanError, match="dtype 'ä:1' is not one of"):
        Plan.from_json({**obj, "dtype": "ä:1"})


def test_check_cover_rejects_gaps():
    with pytest.raises(PlanError):
        check_cover(0, [(0, 3), (4, 8)], 8)
    with pytest.raises(PlanError):
        check_cover(0, [(0, 3), (3, 7)], 8)


def test_cluster_files_exist():
    names = {p.name for p in (REPO / "clusters").glob("*.yaml")}
    assert {"demo.yaml", "wan.yaml", "multi-tenant.yaml", "failure.yaml", "impossible.yaml"} <= names
    assert len([n for n in names if n.startswith("bench-")]) >= 3
    assert Path(REPO / "clusters/bench-mesh-200.yaml").read_text().count("device:") == 200


def test_plan_judge_prints_the_plan_simulate_runs():
    """`--plan --judge`: the plan `--simulate` reports as meshllm (the simulator picks among the
    search's candidates and the baselines' groupings, sim/judge.py), progress on stderr, and the
    simulator's figures at the planned rate. On failure.yaml it keeps the nodes' `roles:` (it
    was 4 mixed replicas, fog-1 [prefill] and fog-2/3 [decode] among them: the search's
    all-mixed candidate broke them, while the baselines it was measured against kept them)."""
    from meshllm.sim.judge import JUDGE_REQUESTS, JUDGE_SEED, JUDGE_SWEEP_REQUESTS, SIMULATED
    from meshllm.sim.metrics import metrics
    from meshllm.sim.sweep import make_trace, meshllm_policy, saturation_rate, simulate

    path = REPO / "clusters" / "failure.yaml"
    r = run_cli("--plan", str(path), "--judge", "--json")
    assert r.returncode == 0, r.stderr
    assert "judge: candidate 1/" in r.stderr and "judge: picked candidate" in r.stderr
    got = [(x["role"], [s["node"] for s in x["stages"]], [s["layers"][1] - s["layers"][0] for s in x["stages"]])
           for x in json.loads(r.stdout)["replicas"]]
    allowed = {n.id: {str(r) for r in n.roles or ("prefill", "decode")} for n in load_cluster(path).nodes}
    for role, nodes, _ in got:
        need = {"prefill", "decode"} if role == "mixed" else {role}
        assert all(need <= allowed[n] for n in nodes), (role, nodes, got)
    inp = plan_inputs(load_cluster(path))
    reps = meshllm_policy(inp, inp.rate_per_s, 0).replicas
    assert got == [(rep.role, [m.id for m in rep.members], list(rep.counts)) for rep in reps]
    # beside the analytic prediction, the simulator's figures at the same rate, on the judge's trace
    obj = json.loads(r.stdout)
    sim, rate = obj["simulated"], obj["prediction"]["rate_per_s"]
    m = metrics(simulate(reps, make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED), rate))
    sustains = sim.pop("saturation_req_s")
    assert sim == {"rate_per_s": rate, "requests": JUDGE_REQUESTS, **{k: round(m[k], 3) for k in SIMULATED}}
    assert all(len(f"{v}".partition(".")[2]) <= 3 for v in sim.values()), sim  # ms to 3 places, as `prediction`
    assert len(f"{sustains}".partition(".")[2]) <= 6
    assert sustains == pytest.approx(saturation_rate(reps, inp, JUDGE_SEED, JUDGE_SWEEP_REQUESTS), rel=0.1)
    assert Plan.from_json(obj).to_json() == obj  # a coordinator could publish it as it is
    obj["simulated"]["saturation_req_s"] = sustains
    assert json.loads(run_cli("--plan", str(path), "--json").stdout)["simulated"] == {}  # the search alone


def test_coordinator_plans_with_the_judge_when_its_node_file_asks(monkeypatch):
    """roles/coordinator.py `plan_for`: with `plan_judge` the live plan is the simulator's pick (on
    failure.yaml 4 replicas, 2 prefill and 2 decode, within the nodes' roles:), without it the
    search's, as `--plan` prints each. (There the two are the same plan: the simulator's judge
    is asked only for the first.)"""
    from dataclasses import replace

    from meshllm.emulate import node_file
    from meshllm.node_config import parse_node
    from meshllm.roles.coordinator import plan_for
    from meshllm.sim import judge

    asked = []
    real = judge.simulated_judge
    monkeypatch.setattr(judge, "simulated_judge", lambda *a, **k: asked.append(1) or real(*a, **k))
    cfg = load_cluster(REPO / "clusters" / "failure.yaml")
    inp = plan_inputs(cfg)
    nc = parse_node(node_file(cfg.nodes[0], cfg, "127.0.0.1:7000", "127.0.0.1:7100", judge=True), "n.yaml")
    judged = plan_for(nc, inp)
    assert asked and judged.replicas == judge.judged_plan(inp).replicas
    asked.clear()
    plain = plan_for(replace(nc, plan_judge=False), inp)
    assert not asked and plain.replicas == plan_cluster(inp, log=False).replicas
    assert sorted(str(r.role) for r in judged.replicas) == ["decode", "decode", "prefill", "prefill"]


def test_a_drafter_must_hold_the_draft_and_one_fp32_layer_while_it_builds_it():
    """Drafters build the draft a layer at a time (weights.load_quantized): a node is a drafter when
    the W4A16 draft and one fp32 layer of the target fit its memory, not the draft alone."""
    from meshllm.partition.cost import model_costs

    data = {"model": "llama-3-8b", "nodes": [{"id": "gpu", "device": "desktop-rtx-4090", "zone": "f"}]}
    args = plan_inputs(parse_cluster(data, "inline.yaml")).args
    draft, layer = model_costs(args, "int4").weight_bytes, model_costs(args, "fp32").layer_bytes
    for nid, gb in (("tight", (draft + layer / 2) / 1e9), ("room", (draft + layer * 1.01) / 1e9)):
        data["nodes"].append({"id": nid, "zone": "e", "roles": ["drafter"], "device": {
            "name": nid, "memory_gb": gb, "compute_tflops": 1, "memory_bandwidth_gbps": 60, "network_mbps": 1000,
            "source": "test profile"}})
    plan = plan_cluster(plan_inputs(parse_cluster(data, "inline.yaml")), log=False)
    assert "room" in plan.drafters and "tight" not in plan.drafters and "tight" in plan.unused

"""Why meshllm's saturation stays below 0.93 of the physical bound on the bench clusters.

Run:  python bench/bound_gap.py [--clusters bench-edge-8b,bench-fog-40-8b,bench-six-7b]
      [--replicas bench-fog-70b] [--splits bench-six-7b] [--requests 2000] [--seed 0] [--jobs 2]
      (~13 min on 2 cores for the default three clusters, ~2 more for the replicas table,
      ~14 more for the splits table)

The bound (meshllm/sim/metrics.py, README) is the rate at which every stage-capable device is
100% busy on useful FLOPs. Per device type of a cluster, the type's devices alone (the same
workload, links and trace lengths) are served as tuned Splitwise and mixed-dp would serve them,
and the better one's saturation (sim/sweep.py's stability rule) is printed as a fraction of
the type's own bound: what that hardware reaches on its own, with no other device to help or
to hinder. A type that cannot hold the model alone says so. The cluster's bound is the sum of
its types' (to rounding), so the types' reach weighted by their share of the bound says how
far a cluster of them gets by serving each type apart; meshllm's own fraction
(bench/results/planner.json) is printed beside it.

Where every type can stand alone, the whole cluster as mixed-dp (the same replicas, one router)
at JOINT_LOAD x the sum of the types' mixed-dp saturations: per type, the rate its replicas are
routed, against what they sustain alone, and its mean wait there, beside its mean wait alone at
LOAD x its own saturation (and the mean prompt of the requests routed to it: the router does not
send every type the same mix of prompts). The router balances waits, not utilisation: a type whose own
saturation comes only at long waits (a slow pipeline, whose service time is long, so the
stability rule's wait cap is too) is not loaded that far beside fast types.

Then, for the type with the largest share, where its time goes at 95 % of that saturation: a
mixed replica's time in steps that only decode (no prompt waits, and a decode step is
memory-bound: its compute mostly idle), in steps with prompt tokens riding along (chunked
prefill, compute-bound), and in whole-prompt steps, with the linear layers' FLOPs of each as
a fraction of the device's compute in that time (attention left out, so slightly low).

`--replicas` (default bench-fog-70b, whose device types cannot hold llama-2-70b alone): meshllm's
plan for capacity (the judged plan, as bench/planner.py builds it), and per replica, alone as a
mixed replica, its saturation against its own devices' bound, then two what-ifs: decode slots
of MAX_DECODE_BATCH per micro-batch (one micro-batch per stage, as vLLM's per-virtual-engine
schedulers allow under pipeline parallelism; the simulator allows MAX_DECODE_BATCH per replica,
and neither it nor the planner makes this what-if), where their KV fits, and on top of that
the DP's decode split made to keep room for more sequences' KV on every stage (KV_RESERVES;
the DP keeps room for KV_RESERVE_SEQS, and the judge, for capacity, tries KV_ROOMS of
sim/turns.py where the plan sustains more on the evidence), the best of those (not for the
plan's prefill replicas: they keep their split, the DP's for prompts). Then the whole plan, as planned and with each
replica at its best what-if. It says how much of the gap a longer decode batch would close.

`--splits` (default bench-six-7b, whose Orin Nanos and Mac mini hold llama-2-7b only together):
meshllm's plan for capacity, and for each of its replicas of several devices, every split of
the model's layers over them (every order of its members, up to interchangeable ones; at least
one layer a stage) whose KV room holds one sequence or more, each alone as a mixed replica: per
number of sequences the split's KV room holds, the best split's saturation, which says whether
any split of those devices does better than the planned one. Then the whole plan with that
replica prefilling on the DP's prefill split (its prompts' KV shipped to the other replicas).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.config import load_cluster, plan_inputs  # noqa: E402
from meshllm.partition.cost import flops_per_s  # noqa: E402
from meshllm.partition.dp import Infeasible, Splitter  # noqa: E402
from meshllm.partition.plan import PlanInfeasible  # noqa: E402
from meshllm.partition.replica import MAX_DECODE_BATCH  # noqa: E402
from meshllm.sim import sweep  # noqa: E402
from meshllm.sim.baselines import mixed_dp, splitwise  # noqa: E402
from meshllm.sim.metrics import bound_rate_per_s  # noqa: E402
from meshllm.sim.replica import SimReplica  # noqa: E402
from meshllm.sim.simulator import Simulator  # noqa: E402

DEFAULT = ("bench-edge-8b", "bench-fog-40-8b", "bench-six-7b")  # the 70b clusters' types cannot stand alone
LOAD = 0.95  # the time breakdown's rate, of the type's saturation
JOINT_LOAD = 0.9  # the whole cluster's rate, of the sum of its types' mixed-dp saturations
KINDS = ("decode only", "chunked", "whole prompts")
KV_RESERVES = (64, 256, 512, 1024)  # --replicas: sequences of KV the decode split keeps room for, tried


class StepLog(Simulator):
    """The simulator, with the time of each run of steps of a mixed replica booked by its kind."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.kind: dict[int, str] = {}
        self.time = defaultdict(float)
        self.flops = defaultdict(float)

    def run_steps(self, st) -> None:
        super().run_steps(st)
        _, _, iters, chunk, _, micro = st.chunk
        whole = chunk and iters == 1 and micro == 1 and chunk == sum(r.n_in - d for r, d in st.prefilling)
        self.kind[st.rep.id] = KINDS[0] if not chunk else (KINDS[2] if whole else KINDS[1])

    def on_chunk(self, st, version: int) -> None:
        if version == st.version and st.chunk and st.rep.role == "mixed":
            _, step, iters, chunk, _, _ = st.chunk
            kind, mc = self.kind[st.rep.id], st.rep.inp.mc
            self.time[kind] += step * iters
            self.flops[kind] += (len(st.active) + chunk) * iters * mc.n_layers * mc.layer_flops_per_token
            self.flops[kind + " peak"] += step * iters * sum(flops_per_s(m.device) for m in st.rep.members)
        super().on_chunk(st, version)


class Placed(Simulator):
    """The simulator, with the replica each request was routed to (`where`: request id -> replica id)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.where: dict[int, int] = {}
        self._arriving = -1
        pick = self.router.pick_prefill

        def recorded(*a):
            self.where[self._arriving] = got = pick(*a)
            return got
        self.router.pick_prefill = recorded

    def on_arrival(self, req) -> None:
        self._arriving = req.rid
        super().on_arrival(req)


def joint(name: str, sat: dict[str, float], n_req: int, seed: int) -> dict:
    """The whole cluster as mixed-dp at JOINT_LOAD x sum(`sat`) (device type -> its mixed-dp
    saturation alone): per type, the rate routed to it and its mean wait."""
    inp = plan_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"))
    reps = mixed_dp(inp).replicas
    rate = JOINT_LOAD * sum(sat.values())
    sim = Placed(reps, sweep.requests_at(sweep.make_trace(inp, n_req, seed), rate))
    reqs = sim.run()
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
    kind = {r.id: r.members[0].device.name for r in reps}
    out = {d: [0, 0.0, 0] for d in sat}
    for r in reqs:
        got = out[kind[sim.where[r.rid]]]
        got[0] += 1
        got[1] += r.wait_s
        got[2] += r.n_in
    return {"rate": rate, "wait": sum(r.wait_s for r in reqs) / len(reqs), "prompt": sum(r.n_in for r in reqs) / len(reqs),
            "stable": sweep.stable(reqs),
            "types": {d: (n / span, w / n if n else 0.0, t / n if n else 0.0) for d, (n, w, t) in out.items()}}


def alone_wait(job: tuple) -> float:
    """Mean wait of one type's mixed-dp replicas alone at LOAD x its saturation."""
    name, device, sat, n_req, seed = job
    inp = type_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"), device)
    reqs = sweep.simulate(mixed_dp(inp).replicas, sweep.make_trace(inp, n_req, seed), LOAD * sat, gaps=False)
    return sum(r.wait_s for r in reqs) / len(reqs)


def nodes_inputs(cfg, ids: set[str]):
    """The planner's inputs for the nodes of `cfg` named in `ids` only (same workload and links)."""
    return plan_inputs(replace(cfg, nodes=tuple(n for n in cfg.nodes if n.id in ids)))


def type_inputs(cfg, device: str):
    return nodes_inputs(cfg, {n.id for n in cfg.nodes if n.device.name == device})


def reach(job: tuple) -> dict:
    """One device type of one cluster alone: its bound, the better baseline's saturation."""
    name, device, n_req, seed = job
    cfg = load_cluster(REPO / "clusters" / f"{name}.yaml")
    lengths = [(a, b) for _, a, b in sweep.make_trace(plan_inputs(cfg), n_req, seed)]
    inp = type_inputs(cfg, device)
    out = {"cluster": name, "device": device, "devices": sum(n.device.name == device for n in cfg.nodes),
           "bound": bound_rate_per_s(inp, lengths), "sat": {}}
    for build in (splitwise, mixed_dp):
        try:
            reps = build(inp).replicas
        except PlanInfeasible:
            reps = []
        out["sat"][build.__name__] = sweep.saturation_rate(reps, inp, seed, n_req) if reps else 0.0
    return out


def breakdown(name: str, device: str, sat: float, n_req: int, seed: int) -> dict:
    """Where a type's mixed replicas spend their time at LOAD x `sat` (module docstring)."""
    inp = type_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"), device)
    sim = StepLog(mixed_dp(inp).replicas, sweep.requests_at(sweep.make_trace(inp, n_req, seed), LOAD * sat))
    reqs = sim.run()
    span = max(r.done for r in reqs) - min(r.arrival for r in reqs)
    busy = sum(sim.time.values())
    return {"rate": LOAD * sat, "replica_s": span * len(sim.states), "busy_s": busy,
            "kinds": {k: (sim.time[k], sim.flops[k] / sim.flops[k + " peak"] if sim.time[k] else 0.0)
                      for k in KINDS}}


class MicroSlots(SimReplica):
    """A replica with MAX_DECODE_BATCH decode slots per micro-batch (one per stage), where their
    KV fits (the --replicas what-if; SimReplica.max_batch caps the replica at MAX_DECODE_BATCH)."""

    def max_batch(self) -> int:
        mix = self.inp.mix
        return max(0, min(MAX_DECODE_BATCH * len(self.members), int(self.kv_capacity_tokens() // (mix.mean_in + mix.mean_out))))


def kv_room_split(inp, members: tuple, reserve: int) -> tuple | None:
    """(members in pipeline order, layer counts) of the DP's decode split keeping KV room for
    `reserve` mean sequences on every stage; None where that does not fit."""
    got = Splitter(inp.mc, inp.net, inp.mix.decode_wp(reserve)).split(members)
    return None if isinstance(got, Infeasible) else (tuple(members[i] for i in got.order), got.counts)


def replica_job(job: tuple) -> dict:
    """One replica of meshllm's plan alone (mixed): its devices' bound, its saturation as planned,
    with slots per micro-batch, and with the best KV-room split too (not for a prefill replica of
    the plan: it holds no decode's KV there, and its split is the DP's for prompts)."""
    name, role, ids, counts, n_req, seed = job
    cfg = load_cluster(REPO / "clusters" / f"{name}.yaml")
    lengths = [(a, b) for _, a, b in sweep.make_trace(plan_inputs(cfg), n_req, seed)]
    inp = nodes_inputs(cfg, set(ids))
    by = {m.id: m for m in inp.members}
    members = tuple(by[i] for i in ids)
    sat = lambda r: sweep.saturation_rate([r], inp, seed, n_req)  # noqa: E731
    planned, micro = SimReplica(0, "mixed", members, counts, inp), MicroSlots(0, "mixed", members, counts, inp)
    out = {"ids": ids, "bound": bound_rate_per_s(inp, lengths), "plan": sat(planned), "micro": sat(micro),
           "slots_plan": planned.max_batch(), "slots_rep": micro.max_batch()}
    out["kv"], out["reserve"], out["split"] = out["micro"], 0, (ids, counts)
    for reserve in KV_RESERVES if role != "prefill" else ():
        got = kv_room_split(inp, members, reserve)
        if got is None:
            break
        seq, cs = got
        r = MicroSlots(0, "mixed", seq, cs, inp)
        s = sat(r)
        if s > out["kv"]:
            out["kv"], out["reserve"], out["split"] = s, reserve, ([m.id for m in seq], cs)
    return out


def plan_job(job: tuple) -> float:
    """The saturation of a whole plan given as (role, ids, counts) per replica; `micro`: with
    slots per micro-batch."""
    name, rows, micro, n_req, seed = job
    inp = plan_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"))
    by = {m.id: m for m in inp.members}
    cls = MicroSlots if micro else SimReplica
    reps = [cls(k, role, tuple(by[i] for i in ids), tuple(counts), inp) for k, (role, ids, counts) in enumerate(rows)]
    return sweep.saturation_rate(reps, inp, seed, n_req)


def replicas_section(name: str, n_req: int, seed: int, jobs: int) -> None:
    """--replicas (module docstring)."""
    inp = plan_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"))
    reps = sweep.meshllm_policy(inp, 0.0, seed).replicas
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(replica_job, [(name, r.role, [m.id for m in r.members], tuple(r.counts), n_req, seed)
                                           for r in reps]))
        planned = [(r.role, [m.id for m in r.members], tuple(r.counts)) for r in reps]
        best = [(r.role, *row["split"]) for r, row in zip(reps, rows)]
        whole = list(pool.map(plan_job, [(name, planned, False, n_req, seed), (name, best, True, n_req, seed)]))
    print(f"## {name}: meshllm's plan for capacity, each replica alone (mixed) against its devices' bound")
    print("bound: its devices'; slots: decode slots as planned, then per micro-batch where the KV fits; "
          "kv room: the best reserve of KV_RESERVES (- none better)")
    print(f"{'bound':>7s} {'slots':>5s} {'plan':>7s} {'of it':>6s} {'slots/µb':>8s} {'sat':>7s} "
          f"{'kv room':>7s} {'sat':>7s} {'of it':>6s}  replica")
    for r, row in zip(reps, rows):
        kinds = defaultdict(int)
        for m in r.members:
            kinds[m.device.name] += 1
        what = ", ".join(f"{n} {d}" for d, n in kinds.items())
        print(f"{row['bound']:7.3f} {row['slots_plan']:5d} {row['plan']:7.3f} "
              f"{row['plan'] / row['bound']:6.3f} {row['slots_rep']:8d} {row['micro']:7.3f} "
              f"{row['reserve'] or '-':>7} {row['kv']:7.3f} {row['kv'] / row['bound']:6.3f}  {r.role}: {what}")
    bound = bound_rate_per_s(inp, [(a, b) for _, a, b in sweep.make_trace(inp, n_req, seed)])
    print(f"the whole plan: {whole[0]:.3f} req/s ({whole[0] / bound:.3f} of the cluster's bound {bound:.3f}); "
          f"each replica with slots per micro-batch and its best KV-room split: {whole[1]:.3f} "
          f"({whole[1] / bound:.3f})")
    print()


def split_job(job: tuple) -> tuple:
    """One split of some devices' layers alone as a mixed replica: (KV room in sequences, saturation)."""
    name, ids, counts, n_req, seed = job
    inp = nodes_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"), set(ids))
    by = {m.id: m for m in inp.members}
    r = SimReplica(0, "mixed", tuple(by[i] for i in ids), counts, inp)
    return r.max_batch(), sweep.saturation_rate([r], inp, seed, n_req)


def every_split(inp, members: tuple) -> list[tuple]:
    """(ids in pipeline order, layer counts) of every split of `members` (each order up to
    interchangeable members, at least one layer a stage) whose KV room holds a sequence."""
    orders = {tuple(m.key for m in p): p for p in itertools.permutations(members)}.values()
    out, n = [], inp.mc.n_layers
    for seq in orders:
        for cuts in itertools.combinations(range(1, n), len(seq) - 1):
            counts = tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))
            if SimReplica(0, "mixed", seq, counts, inp).max_batch() >= 1:
                out.append(([m.id for m in seq], counts))
    return out


def splits_section(name: str, n_req: int, seed: int, jobs: int) -> None:
    """--splits (module docstring)."""
    cfg = load_cluster(REPO / "clusters" / f"{name}.yaml")
    inp = plan_inputs(cfg)
    lengths = [(a, b) for _, a, b in sweep.make_trace(inp, n_req, seed)]
    reps = sweep.meshllm_policy(inp, 0.0, seed).replicas
    planned = [(r.role, [m.id for m in r.members], tuple(r.counts)) for r in reps]
    print(f"## {name}: meshllm's plan for capacity, its replicas of several devices split every way (alone, mixed)")
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        as_planned = pool.submit(plan_job, (name, planned, False, n_req, seed))
        for k, r in enumerate(reps):
            if len(r.members) < 2:
                continue
            ids = [m.id for m in r.members]
            bound = bound_rate_per_s(nodes_inputs(cfg, set(ids)), lengths)
            splits = every_split(inp, tuple(r.members))
            got = list(pool.map(split_job, [(name, i, c, n_req, seed) for i, c in splits]))
            mine = split_job((name, ids, tuple(r.counts), n_req, seed))
            print(f"-- replica {k} ({r.role}): {', '.join(f'{i} {c}' for i, c in zip(ids, r.counts))} as planned: "
                  f"KV room for {mine[0]} sequences, {mine[1]:.3f} req/s alone, {mine[1] / bound:.3f} of its "
                  f"devices' bound {bound:.3f}; {len(splits)} splits hold a sequence")
            best: dict[int, tuple] = {}
            for (i, c), (slots, sat) in zip(splits, got):
                if slots not in best or sat > best[slots][0]:
                    best[slots] = (sat, i, c)
            print(f"{'seqs':>5s} {'best sat':>9s} {'of bound':>9s}  its split")
            for slots in sorted(best, reverse=True):
                sat, i, c = best[slots]
                print(f"{slots:5d} {sat:9.3f} {sat / bound:9.3f}  {', '.join(f'{x} {n}' for x, n in zip(i, c))}")
            sp = Splitter(inp.mc, inp.net, inp.mix.prefill_wp()).split(tuple(r.members))
            if isinstance(sp, Infeasible):
                continue
            turned = [*planned[:k], ("prefill", [r.members[j].id for j in sp.order], sp.counts), *planned[k + 1:]]
            whole = plan_job((name, turned, False, n_req, seed))
            print(f"the whole plan: {as_planned.result():.3f} req/s as planned; with replica {k} prefilling on the "
                  f"DP's prefill split ({', '.join(f'{x} {n}' for x, n in zip(turned[k][1], sp.counts))}): {whole:.3f}")
    print()


def meshllm_fraction(name: str) -> float | None:
    saved = REPO / "bench/results/planner.json"
    if not saved.exists():
        return None
    for c in json.loads(saved.read_text())["clusters"]:
        if c["name"] == name and c["bound"]:
            return c["sat"]["meshllm"] / c["bound"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default=",".join(DEFAULT))
    ap.add_argument("--requests", type=int, default=sweep.SWEEP_REQUESTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--replicas", default="bench-fog-70b", help="clusters for the per-replica table ('' for none)")
    ap.add_argument("--splits", default="bench-six-7b", help="clusters for the splits table ('' for none)")
    a = ap.parse_args()
    names = [n for n in a.clusters.split(",") if n]
    # the judge's own pool (meshllm/sim/pool.py) in each of these processes: the CPUs shared out
    os.environ.setdefault("MESHLLM_SIM_JOBS", str(max(1, (os.cpu_count() or 1) // max(1, a.jobs))))
    jobs = [(name, device, a.requests, a.seed) for name in names
            for device in sorted({n.device.name for n in load_cluster(REPO / "clusters" / f"{name}.yaml").nodes})]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        results = list(pool.map(reach, jobs))
    for name in names:
        rows = [r for r in results if r["cluster"] == name]
        total = sum(r["bound"] for r in rows)
        print(f"## {name}: the bound per device type, and what the type reaches alone "
              f"(better of splitwise / mixed-dp)")
        print(f"{'device':24s} {'n':>3s} {'bound':>8s} {'share':>6s} {'splitwise':>10s} {'mixed-dp':>9s} {'reach':>6s}")
        got = 0.0
        for r in sorted(rows, key=lambda r: -r["bound"]):
            best = max(r["sat"].values())
            got += best
            frac = f"{best / r['bound']:.3f}" if best > 0 else "cannot hold the model alone"
            print(f"{r['device']:24s} {r['devices']:3d} {r['bound']:8.3f} {r['bound'] / total:6.3f} "
                  f"{r['sat']['splitwise']:10.3f} {r['sat']['mixed_dp']:9.3f} {frac:>6s}")
        mine = meshllm_fraction(name)
        print(f"the types apart: {got:.3f} req/s, {got / total:.3f} of the types' bounds; meshllm on the whole "
              f"cluster: {'-' if mine is None else f'{mine:.3f}'} of its bound (bench/results/planner.json)")
        if len(rows) > 1 and all(r["sat"]["mixed_dp"] > 0 for r in rows):
            sat = {r["device"]: r["sat"]["mixed_dp"] for r in sorted(rows, key=lambda r: -r["bound"])}
            with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:  # the joint run beside the types'
                whole = pool.submit(joint, name, sat, a.requests, a.seed)
                waits = list(pool.map(alone_wait, [(name, d, x, a.requests, a.seed) for d, x in sat.items()]))
                j = whole.result()
            print(f"the whole cluster as mixed-dp (one router) at {j['rate']:.3f} req/s ({JOINT_LOAD:.0%} of the types' "
                  f"mixed-dp saturations summed): mean wait {j['wait']:.3f} s, "
                  f"{'stable' if j['stable'] else 'NOT stable'} by the stability rule; mean prompt {j['prompt']:.0f} tokens")
            print(f"{'device':24s} {'routed':>7s} {'alone':>7s} {'of it':>6s} {'prompt':>7s} {'wait s':>7s} "
                  f"{'alone: wait s at ' + format(LOAD, '.0%'):>22s}")
            for (d, x), w in zip(sat.items(), waits):
                routed, wait, prompt = j["types"][d]
                print(f"{d:24s} {routed:7.3f} {x:7.3f} {routed / x:6.2f} {prompt:7.0f} {wait:7.3f} {w:22.3f}")
        top = max(rows, key=lambda r: r["bound"])
        if top["sat"]["mixed_dp"] > 0:
            b = breakdown(name, top["device"], top["sat"]["mixed_dp"], a.requests, a.seed)
            print(f"{top['device']} alone as mixed-dp at {b['rate']:.3f} req/s ({LOAD:.0%} of its saturation): "
                  f"busy {b['busy_s'] / b['replica_s']:.3f} of the time")
            for k, (t, eff) in b["kinds"].items():
                print(f"  {k:14s} {t / b['replica_s']:6.3f} of the time, linear-layer FLOPs {eff:.3f} of its compute")
        print()
    for name in (n for n in a.replicas.split(",") if n):
        replicas_section(name, a.requests, a.seed, a.jobs)
    for name in (n for n in a.splits.split(",") if n):
        splits_section(name, a.requests, a.seed, a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

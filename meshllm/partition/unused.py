"""Why each node outside every replica is there (the plan's `unused_reasons` / `drafter_reasons`).

A node is left out of the replicas because its `roles:` allow no stage, because it cannot
hold one layer beside the KV budget, or because no replica gains from it: every single move
that puts it to work (joining one of the replicas, or alone as a new one) is tried, and the
reason quotes the best one's capacity against the plan's (or its cost at the planned rate,
when it adds capacity but the users would wait longer); a device that cannot hold the model
alone also gets what the best new replica of it with other devices left out would do and why
it is not formed (the replicas `form_replicas` tries), or that no such replica can be packed.
Both sides are the search's analytic
rating (`Evaluator.decode`: the DP's splits, the GA's roles for capacity; for the cost, the roles
that wait least at the rate, `Evaluator.rated`), also where the simulated judge
re-rated the plan after turning roles or re-splitting a pipeline (sim/turns.py, steps 6-7)."""

from __future__ import annotations

from meshllm.defaults import Role
from meshllm.partition.capacity import role_rates
from meshllm.partition.cost import DRAFT_DTYPE, model_costs
from meshllm.partition.dp import memory_cap_layers, shortfall_reason
from meshllm.partition.genetic import PACK_SLACK, idle_packs, predicted_cost
from meshllm.partition.grouping import MIN_REPLICA_SHARE, NONE, Evaluator, Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.latency import WAIT_WEIGHT

REASON_MOVES = 12  # replicas tried per left-out device when finding why it adds nothing


def genes_of(ev: Evaluator, grouping: Grouping) -> list[int]:
    genes = [NONE] * len(ev.members)
    for label, group in enumerate(grouping.groups):
        for i in group:
            genes[i] = label
    return genes


def best_move(ev: Evaluator, genes: list[int], i: int) -> tuple[float, list[int], str] | None:
    """(capacity, genes, where) of the best single move putting member i in a replica: alone (if it
    can hold the model alone), or into one of the REASON_MOVES replicas with the fewest devices
    (where one more device weighs most); None if there is no such move."""
    n_groups = max(genes, default=NONE) + 1
    sizes = {label: genes.count(label) for label in range(n_groups)}
    labels = sorted(sizes, key=lambda x: (sizes[x], x))[:REASON_MOVES]
    if not ev.replica([i])[1].reason:
        labels.append(n_groups)
    best = None
    for label in labels:
        trial = list(genes)
        trial[i] = label
        cap = ev.fitness(trial)
        if best is None or cap > best[0]:
            best = (cap, trial, f"replica {label}" if label < n_groups else "alone")
    return best


def with_others(ev: Evaluator, genes: list[int], i: int, packs: list[list[int]], rate: float | None) -> str:
    """What member i would do in a new replica with other devices left out (`idle_packs`, as
    `form_replicas` tries them, the best of those holding it): what the plan would serve with it,
    and why it is not formed (it adds nothing, raises the predicted cost at `rate`, cannot hold
    the model, or is negligible); or that the devices left out are too few to pack one."""
    if not packs:
        idle = [j for j, g in enumerate(genes) if g == NONE]
        gb = sum(ev.members[j].device.memory_gb for j in idle)
        return (f"; no new replica can be packed from the {len(idle)} devices left out ({gb:.2f} GB together; one is "
                f"packed to {PACK_SLACK[0]:g} x the model's need, of nodes whose roles allow one phase)")
    fresh = max(genes, default=NONE) + 1
    best = None
    for group in (g for g in packs if i in g):
        trial = [fresh if j in group else x for j, x in enumerate(genes)]
        got = ev.decode(trial)
        formed = ev.replica(group)[0] in got.groups
        if best is None or (formed, got.fitness) > best[:2]:
            best = (formed, got.fitness, group, trial)
    if best is None:
        return ""
    formed, cap, group, trial = best
    cap0, new = ev.fitness(genes), f"a new replica of it with {len(group) - 1} other devices left out"
    if not formed:
        why = ev.replica(group)[1].reason or f"it would serve under {100 * MIN_REPLICA_SHARE:g} % of what the replicas serve"
        return f"; {new} would not be formed: {why}"
    if cap <= cap0 * (1 + 1e-6):
        return f"; {new} would leave the plan at {cap:.3f} req/s, {cap0:.3f} without it"
    out = f"; {new} adds capacity ({cap:.3f} vs {cap0:.3f} req/s)"
    if rate:
        before, after = (predicted_cost(ev, x, rate) for x in (genes, trial))
        out += (f" but at {rate:.3f} req/s the predicted cost (e2e + {WAIT_WEIGHT:g} x wait) rises from {before:.3f} s "
                f"to {after:.3f} s" if after > before else " and the chosen grouping (the judge's pick) leaves it out")
    return out


def member_reason(ev: Evaluator, grouping: Grouping, genes: list[int], i: int,
                  packs: list[list[int]] | None = None) -> str:
    """Why member i is outside the replicas (`packs`: `idle_packs(ev, genes)`, computed if None)."""
    m = ev.members[i]
    if memory_cap_layers(ev.mc, m.device, False, False, ev.mix.kv_tokens) < 1:
        return f"cannot hold one layer of {ev.mc.name} beside the KV budget ({m.device.memory_gb} GB)"
    alone = ev.replica([i])[1]
    alone_note = f"; alone: {shortfall_reason(ev.mc, [m], ev.mix.prefill_wp())}" if alone.reason else ""
    if alone.reason:
        alone_note += with_others(ev, genes, i, idle_packs(ev, genes) if packs is None else packs,
                                  None if grouping.prediction is None else grouping.prediction.rate_per_s)
    base = ev.decode(genes)  # the grouping as the search rates it, like every move below
    cap0 = base.fitness
    move = best_move(ev, genes, i)
    if move is None:
        return f"no replica to join{alone_note}"
    cap, trial, where = move
    if cap <= cap0 * (1 + 1e-6):
        if not alone.reason and base.groups:
            solo = list(genes)
            solo[i] = max(genes) + 1
            if not any(i in grp for grp in ev.decode(solo).groups):  # decode's rule left it out
                rates = role_rates((*base.evals, alone))
                alone_note = (f"; alone it would serve {max(rates[-1]):.3g} req/s, under "
                              f"{100 * MIN_REPLICA_SHARE:g} % of what the replicas serve, so it forms no replica")
        return (f"adds no capacity: at its best ({where}) the plan serves {cap:.3f} req/s, "
                f"{cap0:.3f} without it{alone_note}")
    pred = grouping.prediction
    if pred is None:
        return f"adds capacity ({where}: {cap:.3f} vs {cap0:.3f} req/s) but was not chosen"
    # each grouping under its roles that wait least at the rate (`Evaluator.rated`), as fill_unused rates them
    before, after = (predicted_cost(ev, x, pred.rate_per_s) for x in (genes, trial))
    cost = f"at {pred.rate_per_s:.3f} req/s the predicted cost (e2e + {WAIT_WEIGHT:g} x wait)"
    if after > before:
        return f"adds capacity ({where}: {cap:.3f} vs {cap0:.3f} req/s) but {cost} rises from {before:.3f} s to {after:.3f} s"
    # the analytic model would take it there: the grouping was chosen otherwise (the simulated
    # judge's pick, or the search tried it in another replica)
    return (f"adds capacity ({where}: {cap:.3f} vs {cap0:.3f} req/s) and there {cost} falls from {before:.3f} s "
            f"to {after:.3f} s, but the chosen grouping (the simulated judge's pick, when judged) leaves it out")


def draft_build_bytes(inp: PlanInputs) -> float:
    """What a drafter holds while it builds the draft: the draft and one fp32 layer of the target
    (weights.load_quantized); inf with speculation off (no draft)."""
    if inp.draft_quant not in DRAFT_DTYPE:
        return float("inf")
    return model_costs(inp.args, DRAFT_DTYPE[inp.draft_quant]).weight_bytes + model_costs(inp.args, "fp32").layer_bytes


def not_drafting(inp: PlanInputs, node) -> str:
    """Why a node whose roles allow drafting is no drafter ('' if it could be one)."""
    if node.roles is not None and Role.DRAFTER not in node.roles:
        return ""
    if inp.draft_quant not in DRAFT_DTYPE:
        return "speculation is off (no draft to serve)"
    need = draft_build_bytes(inp)
    if node.device.memory_bytes < need:
        return (f"its memory ({node.device.memory_bytes / 1e9:.2f} GB) cannot hold the draft while it builds it "
                f"({need / 1e9:.2f} GB: the {inp.draft_quant} draft and one fp32 layer)")
    return ""


def outside_reasons(inp: PlanInputs, ev: Evaluator, grouping: Grouping, drafters: set[str]) -> dict[str, str]:
    """node id -> why it holds no stage, for every node outside the replicas."""
    genes = genes_of(ev, grouping)
    packs = idle_packs(ev, genes)
    index = {m.id: i for i, m in enumerate(ev.members)}
    out = {}
    for n in inp.nodes:
        i = index.get(n.id)
        if i is not None and genes[i] != NONE:
            continue
        if i is None:
            why = f"its roles ({', '.join(str(r) for r in n.roles or ())}) allow no stage"
            if n.id not in drafters and (no := not_drafting(inp, n)):
                why += f", and no draft: {no}"
        else:
            why = member_reason(ev, grouping, genes, i, packs)
        out[n.id] = ("drafter; " if n.id in drafters else "") + why
    return out

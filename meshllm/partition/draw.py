"""PNG of a plan: one column per replica (stages top to bottom, edges along the pipeline),
colour by role, drafters and unused nodes in a row underneath. networkx + matplotlib (Agg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshllm.partition.inputs import PlanInputs

from meshllm.partition.plan import Plan

ROLE_COLOURS = {"prefill": "#f4a261", "decode": "#2a9d8f", "mixed": "#e9c46a", "drafter": "#8ecae6",
                "unused": "#d9d9d9"}


def plan_graph(plan: Plan, inp: PlanInputs):
    import networkx as nx

    g = nx.DiGraph()
    devices = {n.id: n.device.name for n in inp.nodes}
    for col, r in enumerate(plan.replicas):
        for row, s in enumerate(r.stages):
            label = f"{s.node}\n{devices[s.node]}\n[{s.layers[0]},{s.layers[1]})"
            g.add_node(s.node, pos=(col * 2.0, -row), colour=ROLE_COLOURS[str(r.role)], label=label)
        for a, b in zip(r.stages, r.stages[1:]):
            g.add_edge(a.node, b.node)
    bottom = -1 - max((len(r.stages) for r in plan.replicas), default=0)
    extra = [(n, "drafter") for n in plan.drafters] + [(n, "unused") for n in plan.unused]
    for i, (nid, kind) in enumerate(extra):
        g.add_node(nid, pos=(i * 1.2, bottom), colour=ROLE_COLOURS[kind], label=f"{nid}\n{kind}")
    return g


def draw_plan(plan: Plan, inp: PlanInputs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = plan_graph(plan, inp)
    pos = nx.get_node_attributes(g, "pos")
    width = max(6.0, 1.6 * max(len(plan.replicas), 1), 1.0 * (len(plan.drafters) + len(plan.unused)))
    height = max(4.0, 1.2 * (2 + max((len(r.stages) for r in plan.replicas), default=0)))
    fig, ax = plt.subplots(figsize=(min(width, 60), min(height, 40)))
    nx.draw_networkx(g, pos, ax=ax, node_color=[g.nodes[n]["colour"] for n in g.nodes],
                     labels=nx.get_node_attributes(g, "label"), node_size=1800, font_size=6, node_shape="s")
    for col, r in enumerate(plan.replicas):
        ax.text(col * 2.0, 0.7, f"replica {r.id}\n{r.role}", ha="center", fontsize=8, weight="bold")
    fig.suptitle(f"{plan.model}: {len(plan.replicas)} replica{'s' * (len(plan.replicas) != 1)}, {plan.capacity_req_s:.2f} req/s predicted")
    ax.axis("off")
    ax.margins(0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""The planner: roofline cost model (cost.py), layer split (dp.py), replica grouping with roles
(genetic.py, replica.py) and the Plan (plan.py). `plan_cluster` is imported lazily (deap)."""

from meshllm.partition.cost import decode_time_s, link_time_s, model_costs, prefill_time_s

__all__ = ["Plan", "PlanInfeasible", "decode_time_s", "link_time_s", "model_costs", "plan_cluster",
           "prefill_time_s"]


def __getattr__(name: str):
    if name in ("Plan", "PlanInfeasible", "plan_cluster"):
        from meshllm.partition import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'meshllm.partition' has no attribute {name!r}")

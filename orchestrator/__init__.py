"""orchestrator: declare, prove, place, launch and survive large-model training.

    from orchestrator import make_plan, compose
    plan = make_plan(compose(["model=llama3_70b", "cluster.nodes=64", "layout.tp=8"]))

Importing the package does not import torch (only `orchestrator.train` does), nor
Hydra until `compose` is called.
"""
from __future__ import annotations

__all__ = ["make_plan", "compose", "Plan", "PlanError"]


def __getattr__(name: str):
    if name == "compose":
        from orchestrator.config.compose import compose

        return compose
    if name in ("make_plan", "Plan", "PlanError"):
        import orchestrator.plan as plan

        return getattr(plan, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

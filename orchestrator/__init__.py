"""orchestrator: declare, prove, place, launch and survive large-model training.

    from orchestrator import make_plan, compose
    plan = make_plan(compose(["model=llama3_70b", "cluster.nodes=64", "layout.tp=8"]))

Importing the package does not import torch; only `orchestrator.train` does.
"""
from orchestrator.plan import Plan, PlanError, make_plan

__all__ = ["make_plan", "compose", "Plan", "PlanError"]


def compose(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose the Hydra config with command-line style overrides (no run directory)."""
    from orchestrator.cli import compose as _compose

    return _compose(overrides or [], config_name)

"""The planner: compose -> validate -> inventory -> rank order -> cost -> Plan.

Pure Python (no torch import), deterministic, fast enough to sit in front of
every launch. Entry point: `make_plan(cfg) -> Plan`.
"""
from orchestrator.config.errors import PlanError, Problem
from orchestrator.plan.make import make_plan
from orchestrator.plan.plan import Plan

__all__ = ["make_plan", "Plan", "PlanError", "Problem"]

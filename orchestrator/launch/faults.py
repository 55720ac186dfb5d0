"""Fault injection (fault.*) for every launcher that owns its ranks: when it fires. Torch-free.

A node kind (kill_node, slow_node) strikes node fault.kill_node, a rank kind (crash_rank,
segfault_rank, hang_rank) global rank fault.rank. The launcher itself kills a node (kill_node);
the ranks crash (an error, or their own SIGSEGV), hang (the first attempt only: what runs after
the recovery is healthy) or, on the
slow node, sleep fault.slow_s a step (every attempt: the node stays slow; a spare is not).
The ranks read every fault setting from their plan.json (rundir/plan.py, train/trainer.py):
nothing about a fault travels by environment.
"""
from __future__ import annotations

from orchestrator.rundir.plan import fault_step


def armed_step(spec) -> int | None:
    """The step the fault fires after (None: no fault): the rule the ranks read too (rundir.plan)."""
    return fault_step(spec)


"""Fault injection (fault.*) for every launcher that owns its ranks: when it fires, and what
the ranks are told (the runtime acts on it: train/trainer.py). Torch-free.

A node kind (kill_node, slow_node) strikes node fault.kill_node, a rank kind (crash_rank,
hang_rank) global rank fault.rank. The launcher itself kills a node (kill_node); the ranks
crash, hang (the first attempt only: what runs after the recovery is healthy) or, on the
slow node, sleep fault.slow_s a step (every attempt: the node stays slow; a spare is not).
"""
from __future__ import annotations

import random

from orchestrator import rundir
from orchestrator.config.schema import FaultKind, FaultMode

NODE_KINDS = (FaultKind.kill_node, FaultKind.slow_node)  # fault.kill_node names the node; the others fault.rank


def armed_step(spec) -> int | None:
    """The step the fault fires after (None: no fault)."""
    f = spec.fault
    armed = bool(f.nodes()) if f.kind in NODE_KINDS else f.rank is not None
    if not armed:
        return None
    if f.mode == FaultMode.random:
        return random.Random(f.seed).randint(1, max(spec.training.steps - 1, 1))
    return f.at_step


def env(spec, attempt: int, step: int | None) -> dict:
    """What the ranks of this attempt are told of the fault (empty: nothing for them to do)."""
    f = spec.fault
    if step is None:
        return {}
    if f.kind == FaultKind.slow_node:
        return {rundir.ENV_FAULT_MODE: "slow_node", rundir.ENV_FAULT_NODE: str(f.nodes()[0]),
                rundir.ENV_FAULT_STEP: str(step), rundir.ENV_FAULT_SLOW_S: str(f.slow_s)}
    if attempt != 0:
        return {}
    if f.kind not in NODE_KINDS:
        return {rundir.ENV_FAULT_MODE: f.kind.value, rundir.ENV_FAULT_RANK: str(f.rank),
                rundir.ENV_FAULT_STEP: str(step)}
    if f.mode == FaultMode.during_save:
        return {rundir.ENV_FAULT_MODE: "during_save", rundir.ENV_FAULT_NODE: str(f.nodes()[0]),
                rundir.ENV_FAULT_STEP: str(step)}
    return {}

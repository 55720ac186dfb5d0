"""Judgements that need the plan's numbers: cross-node tensor parallelism, memory, blast radius."""
from __future__ import annotations

import copy
import enum
import math

import numpy as np

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config
from orchestrator.plan.inventory import GiB, Memory, inventory
from orchestrator.plan.model import ModelMath
from orchestrator.plan.inventory import fmt_bytes
from orchestrator.plan.stages import build_stages
from orchestrator.plan.topology import Tier
from orchestrator.plan.validate import validate


def judge_cross_node_tp(plan, tier_list: list[Tier]) -> None:
    d, spec, a = plan.layout, plan.spec, plan.axes["tp"]
    if d.tp <= 1 or a.tier == "nvlink":
        return
    gpn = spec.hardware.gpus_per_node
    nv = tier_list[0]
    calls = a.calls_per_step / d.microbatches
    # Transfer time alone (bytes / bandwidth), as the worked example quotes it
    # (tests/test_seed_examples.py); the step adds latency.
    on_net = a.bytes_per_microbatch / (a.gbps * 1e9)
    on_nv = a.bytes_per_microbatch / (nv.gbps * 1e9)
    cost = (f"its {calls:.0f} collectives per micro-batch move {fmt_bytes(a.bytes_per_microbatch)} over the "
            f"{a.gbps:g} GB/s {a.tier} tier: {_secs(on_net)} instead of {_secs(on_nv)} on NVLink, against "
            f"{_secs(plan.step.compute_microbatch_s)} of arithmetic")
    where = (f"layout.tp={d.tp} spans {math.ceil(d.tp / gpn)} nodes of {gpn} GPUs" if d.tp > gpn else
             f"layout.tp={d.tp} groups straddle nodes of {gpn} GPUs (order {plan.order})")
    if spec.layout.allow_cross_node_tp:
        plan.warnings.append(f"WARNING: {where}: {cost}.")
    else:
        plan.errors.append(Problem("layout.tp", f"{where}: {cost}.",
                                   f"keep tp <= {gpn} and innermost (layout.order=auto), or set "
                                   f"layout.allow_cross_node_tp=true to run it anyway."))


def _secs(s: float) -> str:
    """As the worked example quotes them (tests/test_seed_examples.py): 1.61 s, 179 ms; small
    runs' fractions of a millisecond too."""
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.2f} ms"


# The keys the stack, fabric and kernel model added, with their physical ranges (plan/validate.py
# bounds the older keys before planning; these are judged once the plan has numbers to quote).
def judge_memory(plan) -> None:
    spec, d, mem = plan.spec, plan.layout, plan.memory
    if mem.fits:
        return
    parts = ", ".join(f"{k} {getattr(mem, k) / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations",
                                                                     "other"))
    fixes = []
    for key, value in (("training.recompute", "selective"), ("training.recompute", "full"), ("layout.zero", 3)):
        alt = with_value(spec, key, value)
        if alt is None:
            continue
        p = memory_only(alt)
        if p is not None and p.per_gpu_bytes < mem.per_gpu_bytes:
            fixes.append(f"{key}={value} -> {p.per_gpu_bytes / GiB:.1f} GiB")
    if d.pp * 2 <= spec.model.layers:
        fixes.append(f"more pipeline stages (layout.pp={d.pp * 2}) or more nodes")
    plan.errors.append(Problem(
        "hardware.gpu_memory_gb, training.recompute, layout",
        f"stage {mem.stage} needs {mem.per_gpu_bytes / GiB:.1f} GiB per GPU ({parts} GiB) > "
        f"{spec.hardware.gpu_memory_gb:g} GiB on {spec.hardware.name}.",
        "; ".join(fixes) + "." if fixes else "use more GPUs per replica."))


def with_value(spec: Config, dotted: str, value) -> Config | None:
    """A copy of spec with one key changed (None when it already has that value): the
    sections on the key's path are copied, the rest is shared (read, never written)."""
    alt = copy.copy(spec)
    obj = alt
    *path, last = dotted.split(".")
    for p in path:
        child = copy.copy(getattr(obj, p))
        setattr(obj, p, child)
        obj = child
    old = getattr(obj, last)
    if old == value:
        return None
    setattr(obj, last, type(old)(value) if isinstance(old, enum.Enum) else value)
    return alt


def memory_only(spec: Config, mm: ModelMath | None = None) -> Memory | None:
    layout, _, _ = validate(spec)
    if layout is None:
        return None
    mm = mm or ModelMath(spec.model)
    tr = spec.training
    stages = build_stages(mm, layout, tr.seq_len, tr.recompute, tr.flash_attention, spec.cost.attention_flops,
                          spec.stack.selective, tr.recompute_layers, tr.mtp_depth)
    return inventory(stages, layout, spec.hardware, tr, mm.V, spec)


def replica_of_rank(plan) -> np.ndarray:
    """Which replica (the ranks that must live together) each rank belongs to: dense
    replicas, joined wherever an expert group spans several of them."""
    dense = plan.grid()
    label = (np.arange(dense.world) // dense.strides["dp"]) % dense.sizes["dp"]
    d = plan.layout
    if d.ep * d.etp > 1:
        groups = plan.expert_grid().groups(("etp", "ep"))
        rep = np.arange(dense.sizes["dp"])
        while True:  # union-find by minimum label until nothing changes
            lowest = rep[label[groups]].min(axis=1)
            new = rep.copy()
            np.minimum.at(new, label[groups].ravel(), np.repeat(lowest, groups.shape[1]))
            new = new[new]
            if np.array_equal(new, rep):
                break
            rep = new
        label = rep[label]
    return label


def blast_radius(plan, mm: ModelMath) -> dict:
    """What one failure costs: GPUs per replica, replicas per node, MTBF, Young/Daly interval."""
    hw = plan.spec.hardware
    gpn, world = hw.gpus_per_node, plan.world_size
    replica_of = replica_of_rank(plan)
    replicas = len(set(replica_of.tolist()))  # (np.unique would import numpy.ma: 0.1 s of a dry run)
    per_node = np.sort(replica_of.reshape(-1, gpn) if world % gpn == 0 else replica_of.reshape(1, -1), axis=1)
    replicas_hit = int((1 + (np.diff(per_node, axis=1) != 0).sum(axis=1)).max())
    rate = hw.failures_per_gpu_hour * world  # interruptions per hour
    mtbf_s = 3600.0 / rate if rate > 0 else float("inf")
    ckpt_bytes = 14.0 * mm.total_params  # bf16 weights + fp32 master + Adam m, v
    ckpt_s = ckpt_bytes / (hw.storage_gbps * 1e9)
    interval = math.sqrt(2.0 * ckpt_s * mtbf_s) if math.isfinite(mtbf_s) else None
    per_replica = world // replicas
    return {
        "gpus_per_replica": per_replica,
        "replicas": replicas,
        "replicas_lost_per_node_failure": replicas_hit,
        "gpus_idled_per_node_failure": replicas_hit * per_replica,
        "job_mtbf_hours": mtbf_s / 3600.0,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_seconds": ckpt_s,
        "checkpoint_interval_s": interval,
        "expected_overhead": (ckpt_s / interval + interval / (2 * mtbf_s)) if interval else 0.0,
    }

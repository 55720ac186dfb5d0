"""Re-plan on what survives a failure: keep TP, CP, PP (and EP) and every whole replica that
is left, keep the global batch (failover.batch_policy). Torch-free: the local launcher, the
SLURM supervisor, the in-place policy and the plan's own `blast_radius.after_node_loss` call it.

With batch_policy=keep (the default) the survivors keep the global batch exact even when
they do not divide it: its micro-batches split unevenly (training.uneven_batch, the first
M % dp replicas take one more) and the plan costs the slowest replica. `even` keeps only
even splits (a smaller micro-batch, else fewer nodes); `adjust` rounds the batch down."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from orchestrator.config.schema import BatchPolicy, Config


MAX_COUNTS, MAX_PLANS = 4096, 16  # node counts looked at (largest first), of them planned


@dataclass
class Replan:
    spec: Config | None
    plan: object | None
    nodes: int
    spare_gpus: int
    changes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Batch:
    micro_batch: int
    global_batch: int
    uneven: bool
    change: str | None = None  # what changed, said plainly (None: nothing)


def batch_for(spec: Config, dp: int) -> Batch | str:
    """How `dp` replicas run the global batch under failover.batch_policy; a string says why not."""
    B, b, policy = spec.training.global_batch, spec.training.micro_batch, spec.failover.batch_policy
    if B % (dp * b) == 0:
        return Batch(b, B, False)
    if policy == BatchPolicy.keep and B % b == 0 and B // b >= dp and not spec.model.moe.experts:
        q, extra = divmod(B // b, dp)
        return Batch(b, B, True, f"global_batch {B} split unevenly: {extra} replica(s) take {q + 1} micro-batches, "
                                 f"{dp - extra} take {q}")
    fits = [x for x in range(b - 1, 0, -1) if B % (dp * x) == 0]
    if fits:
        return Batch(fits[0], B, False, f"micro_batch {b} -> {fits[0]} to keep global_batch {B}")
    if policy == BatchPolicy.adjust:
        new_B = (B // (dp * b)) * dp * b
        if new_B == 0:
            return f"dp {dp} x micro_batch {b} exceeds global_batch {B}"
        return Batch(b, new_B, False, f"global_batch {B} -> {new_B} (failover.batch_policy=adjust)")
    return f"global_batch {B} does not split evenly over dp {dp} (failover.batch_policy={policy.value})"


def with_batch(spec: Config, batch: Batch, **training) -> Config:
    return dataclasses.replace(spec, training=dataclasses.replace(
        spec.training, micro_batch=batch.micro_batch, global_batch=batch.global_batch, uneven_batch=batch.uneven,
        **training))


def why_not_in_place(plan) -> str | None:
    """Why this plan cannot lose a copy in place (None: it can)."""
    d, fo = plan.layout, plan.spec.failover
    if plan.spec.trainer.name.value != "orchestrator":
        return (f"in place needs the built-in runtime (trainer={plan.spec.trainer.name.value} restarts on the "
                f"survivors and resumes from its own checkpoint)")
    if not fo.enabled or not fo.in_place:
        return "failover.in_place is off"
    if d.dp_replicate < 2:
        return (f"the model state has one copy (layout.dp_shard={d.dp_shard} = dp): losing a rank loses part of it; "
                f"set layout.dp_shard to a divisor of {d.dp} below it to keep whole copies")
    if d.ep > 1:
        return "expert-parallel groups span the copies of the state"
    return None


def replan_with(plan, dp: int, nodes: int, dp_shard: int | None):
    """The one re-plan, for a restart on the survivors and for a generation decided in place:
    `plan` with `dp` replicas on `nodes` nodes, TP, CP, PP, VP, EP and ETP kept, copies of
    `dp_shard` ranks (None: one copy), the batch under failover.batch_policy (batch_for).
    Returns (spec, plan, batch, None), or why not last (spec and batch kept when it was planned)."""
    from orchestrator.plan.plan import plan_spec

    spec, old = plan.spec, plan.layout
    batch = batch_for(spec, dp)
    if isinstance(batch, str):
        return None, None, None, batch
    derived = ((plan.blast_radius or {}).get("timeouts") or {}).get("derived", [])  # re-derived for the new step
    fo = dataclasses.replace(spec.failover, **{k: None for k in ("quorum_s", "timeout_s") if k in derived})
    new = with_batch(dataclasses.replace(
        spec, failover=fo, cluster=dataclasses.replace(spec.cluster, nodes=nodes),
        layout=dataclasses.replace(spec.layout, dp=dp, search=False, tp=old.tp, cp=old.cp, pp=old.pp,
                                   vp=old.vp, ep=old.ep, etp=old.etp, dp_shard=dp_shard)), batch)
    new_plan = plan_spec(new)
    if not new_plan.valid:
        return new, None, batch, "; ".join(str(e) for e in new_plan.errors)
    return new, new_plan, batch, None


def replan_on_survivors(plan, alive_nodes: int) -> Replan:
    """The best layout on `alive_nodes` nodes keeping TP, CP, PP and EP of `plan`: every whole
    replica that fits on them (the rest of the nodes wait as spares)."""
    spec, old = plan.spec, plan.layout
    gpn, fo = spec.hardware.gpus_per_node, spec.failover
    replica = old.tp * old.cp * old.pp
    unit = replica // math.gcd(replica, gpn)  # node counts that hold whole replicas are its multiples
    start = alive_nodes - alive_nodes % unit
    tried = [] if start == alive_nodes else [f"{alive_nodes} nodes: whole replicas of {replica} GPUs fit on {start}"]
    planned = 0
    for n in range(start, 0, -unit)[:MAX_COUNTS]:
        if planned >= MAX_PLANS:
            tried.append(f"gave up after {MAX_PLANS} layouts that did not plan")
            break
        world = n * gpn
        dp = world // replica
        if dp < fo.min_dp:
            tried.append(f"{n} nodes: dp {dp} < failover.min_dp {fo.min_dp}")
            break
        if world % (old.etp * old.ep * old.pp):
            tried.append(f"{n} nodes: the expert grid etp*ep*pp = {old.etp * old.ep * old.pp} does not divide {world}")
            continue
        # one copy of the state stays one copy; copies keep their size where it still divides dp
        shard = None if old.dp_shard == old.dp or dp % old.dp_shard else old.dp_shard
        new, new_plan, batch, why = replan_with(plan, dp, n, shard)
        planned += new is not None  # a layout planned (a batch that does not split is not one)
        if why is not None:
            tried.append(f"{n} nodes: {why}")
            continue
        changes = [f"dp {old.dp} -> {dp}"] + ([batch.change] if batch.change else [])
        most = -(-(batch.global_batch // batch.micro_batch) // dp)
        changes.append(f"micro-batches per replica {old.microbatches} -> {new_plan.layout.microbatches}" + (
            "" if not batch.uneven else " (the slowest replica's)" if most == new_plan.layout.microbatches else
            f" (the schedule's count: {most} real at most, the rest padding that weighs nothing)"))
        return Replan(new, new_plan, n, (alive_nodes - n) * gpn, changes, tried)
    if not tried:
        tried.append(f"no node survives (alive {alive_nodes})")
    return Replan(None, None, 0, alive_nodes * gpn, [], tried)


def after_node_loss(plan) -> dict:
    """What losing one node costs, before anything runs (blast_radius.after_node_loss): the
    re-plan on the other nodes. Empty figures and the reasons when nothing would go on."""
    nodes = plan.spec.cluster.nodes
    rp = replan_on_survivors(plan, nodes - 1) if nodes > 1 else Replan(None, None, 0, 0, [], ["one node only"])
    if rp.plan is None:
        return {"nodes": 0, "dp": 0, "global_batch": 0, "step_s": None, "problems": rp.problems[-3:]}
    return {"nodes": rp.nodes, "dp": rp.plan.layout.dp, "global_batch": rp.spec.training.global_batch,
            "step_s": rp.plan.step.wall_s, "uneven_batch": rp.spec.training.uneven_batch,
            "microbatches": rp.plan.layout.microbatches, "spare_gpus": rp.spare_gpus}

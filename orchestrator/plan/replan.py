"""Re-plan on the nodes that survive a failure: keep TP, CP, PP (and EP), shrink DP,
keep the global batch (or adjust it, per failover.batch_policy). Torch-free: both the
local launcher and the SLURM supervisor call it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orchestrator.config.schema import BatchPolicy, Config


@dataclass
class Replan:
    spec: Config | None
    plan: object | None
    nodes: int
    spare_gpus: int
    changes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def replan_on_survivors(plan, alive_nodes: int) -> Replan:
    """The best layout on `alive_nodes` nodes keeping TP, CP, PP and EP of `plan`."""
    from orchestrator.plan.plan import plan_spec

    spec, old = plan.spec, plan.layout
    gpn, fo = spec.hardware.gpus_per_node, spec.failover
    replica = old.tp * old.cp * old.pp
    B, b = spec.training.global_batch, spec.training.micro_batch
    tried = []
    for n in range(alive_nodes, 0, -1):
        world = n * gpn
        if world % replica:
            tried.append(f"{n} nodes: {world} GPUs do not hold whole replicas of {replica}")
            continue
        dp = world // replica
        if dp < fo.min_dp:
            tried.append(f"{n} nodes: dp {dp} < failover.min_dp {fo.min_dp}")
            break
        if world % (old.etp * old.ep * old.pp):
            tried.append(f"{n} nodes: the expert grid etp*ep*pp = {old.etp * old.ep * old.pp} does not divide {world}")
            continue
        changes = [f"dp {old.dp} -> {dp}"]
        new_b, new_B = b, B
        if B % (dp * b):
            fits = [x for x in range(b - 1, 0, -1) if B % (dp * x) == 0]
            if fits:
                new_b = fits[0]
                changes.append(f"micro_batch {b} -> {new_b} to keep global_batch {B}")
            elif fo.batch_policy == BatchPolicy.adjust:
                new_B = (B // (dp * b)) * dp * b
                if new_B == 0:
                    tried.append(f"{n} nodes: dp {dp} x micro_batch {b} exceeds global_batch {B}")
                    continue
                changes.append(f"global_batch {B} -> {new_B} (failover.batch_policy=adjust)")
            else:
                tried.append(f"{n} nodes: global_batch {B} does not split over dp {dp} (batch_policy=keep)")
                continue
        # one copy of the state stays one copy; copies keep their size where it still divides dp
        shard = None if old.dp_shard == old.dp or dp % old.dp_shard else old.dp_shard
        new = dataclasses.replace(
            spec, cluster=dataclasses.replace(spec.cluster, nodes=n),
            layout=dataclasses.replace(spec.layout, dp=dp, search=False, tp=old.tp, cp=old.cp, pp=old.pp,
                                       vp=old.vp, ep=old.ep, etp=old.etp, dp_shard=shard),
            training=dataclasses.replace(spec.training, micro_batch=new_b, global_batch=new_B))
        new_plan = plan_spec(new)
        if not new_plan.valid:
            tried.append(f"{n} nodes: " + "; ".join(str(e) for e in new_plan.errors))
            continue
        changes.append(f"micro-batches per replica {old.microbatches} -> {new_plan.layout.microbatches}")
        return Replan(new, new_plan, n, (alive_nodes - n) * gpn, changes, tried)
    if not tried:
        tried.append(f"no node survives (alive {alive_nodes})")
    return Replan(None, None, 0, alive_nodes * gpn, [], tried)

"""The plan's goodput prediction (plan.md's blast-radius section prints it). Torch-free and cheap:
it runs in every plan.

    predicted ETTR = (1 - checkpoint write / interval) x (1 - time lost per failure / job MTBF)

The time a failure costs depends on its kind, weighed by a failure mix (FAILURE_MIX: Llama 3's
54 days, the mix benchmarks/failover_sim.py replays; one definition, the benchmark imports it).
What each kind costs comes from the plan's own figures: its predicted step, its checkpoint save
and Young/Daly interval, and its timeout ladder (plan/timeouts.py: settle window W, quorum Q,
collective timeout C, hang deadline D). A failure strikes at a uniform point in its step; what
is lost is how much later that step commits than it would have.

In place (several copies of the state, failover.in_place) a warm spare copy takes the lost
copy's place; the survivors wait at the step's boundary (time they would have spent computing
anyway), then

    crash      no wait: the process died, its peers' connections reset at once
    node       the first to know: SLURM naming the node (launcher.node_fail_wait_s); the leader's
               connection unanswered past K when the node held its copy's leader (one node in the
               copy's nodes), else the copy's ranks stalled short of the collective past S (plus the
               supervisor's poll); the coordinator then aborts the survivors' cross-copy all-reduce
               (C only if nobody knew)
    hang       S + poll: the stopped rank is named at the stall deadline (its peers beat that they
               wait in the collective), its node lost, the survivors aborted
    partition  as a node lost, without SLURM: K or S + poll (the leader's connection shares the cut
               path; where it does not and the cut node holds the leader, not modelled here, it
               is C + Q: the collective timeout, the last resort)
    drain      no wait: planned, the drained copy trains on while the supervisor sees SLURM's drain
               (its next poll, launcher.poll_s) and gathers the settle window W; it leaves at the
               boundary of the step the change begins in

and then the generation's groups are rebuilt (REBUILD_STORE_OPS per rank through the job's
store, train/replicas.py; its shards serve their groups at once: rebuild_s) and the step in
flight (the one the change began in) is finished: the survivors keep the gradients they computed,
and only the lost copies' micro-batches are recomputed, spread over the new generation's copies,
then all-reduced (`recompute`: seconds, not the whole step). A restart from the last checkpoint
(not in place, no warm spare left to take over, or the supervisor's node lost) costs the same
wait, the ranks started again (RELAUNCH_S), the checkpoint read back and half the interval redone.
The supervisor's node lost (supervisor_lost_s) costs, on SLURM with more than one node, the lease
timeout L instead of the wait (a standby takes over in the same allocation: launch/batch.py) and
that restart; with no standby (one node) the wait, the restart and the requeue (REQUEUE_S). A plan that is not
in place loses nothing to a drain (the node trains on and is left out of the next launch).

Warm spares: cluster.spare_nodes' whole copies, or where there are none, a pool sized to the
repair pipeline. Every failure sends its node to repair for REPAIR_S, also one that finds no spare
(the copies then shrink in place and the node, once back, rejoins), so the nodes in repair are
every failure of the last REPAIR_S: Poisson with mean REPAIR_S / MTBF (not Erlang's loss, where a
customer that finds every server busy is gone). A failure finds no spare when that count reaches
the pool: no_spare_chance, the Poisson tail; the pool is the smallest with a chance at most
SPARE_MISS (spare_copies). One that finds none shrinks the copies in place (the global batch split
over one copy fewer: the job runs 1/copies slower until a node is back, REPAIR_S / (spares + 1)
on average) instead of restarting.

Checkpoint levels (checkpoint_level): with copies in place only a restart reads a checkpoint back
(the supervisor's node lost, a failure that cannot go on in place), so the plan prices a
snapshot of each rank's state in a peer node's host memory (Gemini's, NVIDIA's local
checkpointing): SNAPSHOT_GBPS to copy it off the GPU (the blocking part), sent to the peer and
persisted to the file system in the background; its interval is Young/Daly's on the failures
that restart (not on every failure: in place loses only the step in flight), a whole number of
steps; a restart reads the peer's copy back at PEER_READ_GBPS and redoes half an interval.
Without copies the file system checkpoint at the plan's Young/Daly interval is the level. The
runtime takes the snapshots every `snapshot_every(plan)` steps (training.checkpoint.snapshot_every,
else the peer-memory interval chosen here, in steps; train/keeper.py) and writes the file system
level at training.checkpoint.every.

The supervisor lives on the first node: one node or partition failure in
`nodes` takes it away (crashes, hangs and drains leave it running); its standby lives on the last.
"""
from __future__ import annotations

import math

# Llama 3 405B pre-training, 54 days on 16,384 H100s: the 419 unexpected interruptions by root cause
# (Llama 3 paper, "The Llama 3 Herd of Models", arXiv:2407.21783, section 3.3.4, Table 5), and the
# kind of failure each is in this model: (cause, count, kind).
LLAMA3_TABLE5 = [("faulty GPU", 148, "crash"), ("GPU HBM3 memory", 72, "crash"), ("software bug", 54, "crash"),
                 ("network switch/cable", 35, "partition"), ("host maintenance", 32, "drain"),
                 ("GPU SRAM memory", 19, "crash"), ("GPU system processor", 17, "crash"), ("NIC", 7, "partition"),
                 ("NCCL watchdog timeouts", 7, "hang"), ("silent data corruption", 6, "crash"),
                 ("GPU thermal interface and sensor", 6, "crash"), ("SSD", 3, "node"), ("power supply", 3, "node"),
                 ("server chassis", 2, "node"), ("IO expansion board", 2, "node"), ("dependency", 2, "crash"),
                 ("CPU", 2, "node"), ("system memory", 2, "node")]
FAILURE_MIX = LLAMA3_TABLE5  # the mix the prediction weighs by
KINDS = ("crash", "node", "hang", "partition", "drain")
SUPERVISOR_KINDS = ("node", "partition")  # the kinds that take the node away: the supervisor's too, if it is there

# Stated, not derived (the plan knows nothing that sets them):
REBUILD_STORE_OPS = 3  # store operations per rank to rebuild a generation's groups (train/replicas.py)
STORE_OPS_S = 25_000.0  # a TCPStore's service rate (benchmarks/failover_sim.py measures ~2.4e4/s on loopback)
RELAUNCH_S = 120.0  # a restart: every rank started again and its world formed, before the checkpoint is read
REQUEUE_S = 300.0  # a one-node job's node lost (no standby): SLURM ends it (NODE_FAIL), starts it again (--requeue)
REPAIR_S = 4 * 3600.0  # a failed node is back in service (as a spare) after this
SPARE_MISS = 0.05  # the pool is sized so that a failure finds no spare at most this often
SNAPSHOT_GBPS = 50.0  # GB/s per GPU to copy its state into pinned host memory (PCIe 5 x16), the blocking part
PEER_READ_GBPS = 25.0  # GB/s per GPU to read a peer node's host-memory snapshot back over the network


def rebuild_s(copies: int, copy_size: int, shards: int, ops_s: float = STORE_OPS_S) -> float:
    """Seconds to rebuild a generation's cross-copy groups (train/replicas.py): `copy_size` groups of
    `copies` members, REBUILD_STORE_OPS store operations a member, on the shard its group's keys live
    on (rundir.store_shard). The shards serve at once: the busiest sets the time."""
    from orchestrator.rundir import store_shard

    per: dict[int, int] = {}
    for p in range(max(1, copy_size)):
        i = store_shard(p, max(1, shards))
        per[i] = per.get(i, 0) + 1
    return REBUILD_STORE_OPS * copies * max(per.values()) / ops_s


def plan_rebuild_s(plan, ops_s: float = STORE_OPS_S) -> float:
    """rebuild_s for a plan: its copies, their size and the store shards the launchers start."""
    from orchestrator.rundir import store_shards

    d = plan.layout
    return rebuild_s(max(1, d.dp_replicate), d.tp * d.cp * d.pp * d.dp_shard,
                     store_shards(plan.world_size, plan.spec.failover.store_shards), ops_s)


def recompute(plan, lost_copies: int = 1, copies_after: int | None = None) -> dict:
    """What the new generation does for the step in flight when `lost_copies` copies were lost
    mid-step and `copies_after` copies go on (the survivors and any spare: default the plan's
    copies, a spare in each lost one's place). The survivors keep the gradients they computed;
    only the lost copies' micro-batches (plan/split.py, the runtime's own split: the first copies,
    which hold the most when the split is uneven) are recomputed, spread over every data rank of
    the new generation: `microbatches` per rank (ceil of lost / data ranks), run through the copy's
    pipeline with its fill and drain (the schedule's bubble, in micro-batches of the plan's slowest
    stage), then the cross-copy gradient all-reduce (the plan's data-parallel traffic time).
    {lost_microbatches, microbatches, compute_s, allreduce_s, seconds}; one definition for the plan's
    in-place cost and benchmarks/failover_sim.py's redo."""
    from orchestrator.plan.split import lost_microbatches, recompute_run

    d, tr = plan.layout, plan.spec.training
    copies = max(1, d.dp_replicate)
    after = copies if copies_after is None else max(1, int(copies_after))
    lost_copies = max(0, min(int(lost_copies), copies))
    M = tr.global_batch // tr.micro_batch
    lost = len(lost_microbatches(M, d.dp, d.dp_shard, range(lost_copies)))
    n = recompute_run(lost, after * d.dp_shard, d.dp_shard, 0) if lost else 0
    st = plan.step
    per_mb = (st.wall_compute + st.wall_tp + st.wall_cp + st.wall_ep) / max(1, d.microbatches) if st else 0.0
    fill = d.schedule.bubble(d.pp, d.vp) if d.pp > 1 and n else 0.0
    dp_axis = (getattr(plan, "axes", None) or {}).get("dp")
    allreduce = dp_axis.seconds if dp_axis is not None else (st.wall_dp_exposed if st else 0.0)
    compute = (n + fill) * per_mb
    return {"lost_microbatches": lost, "microbatches": n, "compute_s": compute, "allreduce_s": allreduce,
            "seconds": compute + allreduce}


def mix_shares(mix=FAILURE_MIX) -> dict[str, float]:
    """{kind: share of the failures} of a mix of (cause, count, kind)."""
    total = sum(n for _, n, _ in mix)
    out = {k: 0.0 for k in KINDS}
    for _, n, kind in mix:
        out[kind] = out.get(kind, 0.0) + n / total
    return out


def spare_copies(plan) -> tuple[int, str]:
    """The warm spare copies a lost copy is replaced from: cluster.spare_nodes' whole copies, or
    where none are set, the smallest pool a failure finds empty at most SPARE_MISS of the time."""
    br, d, gpn = plan.blast_radius, plan.layout, plan.spec.hardware.gpus_per_node
    if plan.spec.cluster.spare_nodes:  # a copy of the state: tp x cp x pp x dp_shard GPUs (launch/inplace.copy_size)
        return plan.spec.cluster.spare_nodes * gpn // (d.tp * d.cp * d.pp * d.dp_shard), "cluster.spare_nodes"
    mtbf_s = br["job_mtbf_hours"] * 3600.0
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        return 1, "one (no failure rate)"
    load, spares = REPAIR_S / mtbf_s, 1
    while no_spare_chance(spares, load) > SPARE_MISS:
        spares += 1
    return spares, f"sized to a {REPAIR_S / 3600:g} h repair at the job MTBF (none left at most {SPARE_MISS:.0%})"


def no_spare_chance(spares: int, load: float) -> float:
    """The chance a failure finds every spare out: at least `spares` nodes in repair, their count
    Poisson with mean `load` (failures per repair time; module docstring)."""
    term = total = math.exp(-load)
    for k in range(1, spares):
        term *= load / k
        total += term
    return max(0.0, 1.0 - total) if spares > 0 else 1.0


def waits(plan, t: dict | None = None) -> dict[str, float]:
    """{kind: seconds from the failure until the survivors can decide}, beyond the boundary of the
    step they would have reached anyway (the module docstring)."""
    from orchestrator.plan.timeouts import keepalive_s, ladder, node_confirm_s, stall_s

    fo, lc = plan.spec.failover, plan.spec.launcher
    step_s = plan.step.wall_s
    t = t or plan.blast_radius.get("timeouts") or ladder(fo, step_s, plan.blast_radius["checkpoint_seconds"])
    c, q, d = t["collective_s"], t["quorum_s"], t["hang_deadline_s"]
    stall = t.get("stall_s", stall_s(step_s, plan.blast_radius["checkpoint_seconds"], d))
    poll = float(getattr(lc, "poll_s", 0.0) or 0.0)  # the supervisor's look at its ranks (the local one: at once)
    named = node_confirm_s(lc) if lc.name.value == "slurm" else poll  # a node's loss told to the coordinator
    keep = t.get("keepalive_s", keepalive_s())
    # a node that holds its copy's leader: the leader's connection is unanswered after K; another node of
    # the copy: the copy's ranks stop short of the cross-copy collective and stall (S, then the poll)
    d = plan.layout
    lead = 1.0 / max(1.0, d.tp * d.cp * d.pp * d.dp_shard / plan.spec.hardware.gpus_per_node)
    cut = lead * min(keep, c + q) + (1 - lead) * min(stall + poll, c + q)
    return {"crash": 0.0, "node": min(named, cut, c), "hang": min(stall + poll, c), "partition": cut, "drain": 0.0}


def checkpoint_level(plan, in_place: bool, restart_rate_s: float) -> dict:
    """The level a restart reads from, its interval, its blocking cost and its read (module docstring)."""
    br = plan.blast_radius
    if not in_place:
        every, ckpt_s = br["checkpoint_interval_s"], br["checkpoint_seconds"]
        return {"level": "file_system", "interval_s": every, "blocking_s": ckpt_s, "read_s": ckpt_s,
                "overhead": ckpt_s / every if every else 0.0}
    d = plan.layout
    per_gpu = br["checkpoint_bytes"] / max(1, d.tp * d.cp * d.pp * d.dp_shard)  # one copy's state, per rank
    snap = per_gpu / (SNAPSHOT_GBPS * 1e9)
    step = plan.step.wall_s
    every = math.sqrt(2 * snap / restart_rate_s) if restart_rate_s > 0 else float("inf")
    every = max(step, math.ceil(min(every, 7 * 86400.0) / step) * step) if step > 0 else every
    return {"level": "peer_memory", "interval_s": every, "blocking_s": snap, "read_s": per_gpu / (PEER_READ_GBPS * 1e9),
            "overhead": snap / every if every else 0.0}


def goodput(plan, mix=FAILURE_MIX) -> dict:
    """The predicted effective training time ratio and what a failure costs (module docstring)."""
    from orchestrator.plan.replan import why_not_in_place

    br = plan.blast_radius
    step_s = plan.step.wall_s
    in_place = why_not_in_place(plan) is None  # the launchers' own rule (copies, built-in runtime, no EP)
    if not br["checkpoint_interval_s"]:
        return {"in_place": in_place, "lost_per_failure_s": 0.0, "predicted_ettr": 1.0}
    mtbf_s = br["job_mtbf_hours"] * 3600.0
    shares, wait = mix_shares(mix), waits(plan)
    rebuild = plan_rebuild_s(plan)
    redo = recompute(plan)  # in place: a spare takes the copy's place, the lost micro-batches recomputed
    kept = {k: wait[k] + rebuild + redo["seconds"] for k in shares}
    spares, spares_from = spare_copies(plan)
    p_empty = no_spare_chance(spares, REPAIR_S / mtbf_s) if in_place else 1.0
    # A failure that takes its node away (node, partition) takes the supervisor with it one time in
    # `nodes`: the standby takes over and the job restarts (supervisor_lost_s). A crash, hang or drain
    # leaves it running.
    p_supervisor = 1.0 / max(1, plan.spec.cluster.nodes)
    restart_share = (p_supervisor * sum(shares[k] for k in SUPERVISOR_KINDS)) if in_place else 1.0
    level = checkpoint_level(plan, in_place, restart_share / mtbf_s)
    base = RELAUNCH_S + level["read_s"] + level["interval_s"] / 2  # started again, the state read, half redone
    restart = {k: wait[k] + base for k in shares}
    if not in_place:
        restart["drain"] = 0.0  # planned: the node trains on and is left out of the next launch
    copies = max(1, plan.layout.dp_replicate)
    short = REPAIR_S / (spares + 1) / copies if in_place else 0.0  # no spare: one copy short until a node is back
    cost = {k: kept[k] + p_empty * short for k in shares} if in_place else dict(restart)
    if in_place:
        for k in SUPERVISOR_KINDS:
            cost[k] = p_supervisor * supervisor_lost_s(plan, base, wait[k]) + (1 - p_supervisor) * cost[k]
    lost = sum(shares[k] * cost[k] for k in shares)
    ettr = (1 - level["overhead"]) * max(0.0, 1 - lost / mtbf_s)
    return {"in_place": in_place, "lost_per_failure_s": lost, "predicted_ettr": ettr,
            "by_kind": {k: {"share": shares[k], "in_place_s": kept[k] if in_place else None, "restart_s": restart[k]}
                        for k in shares},
            "spare_copies": spares if in_place else 0, "spares_from": spares_from if in_place else "",
            "no_spare_chance": p_empty if in_place else 0.0, "restart_share": restart_share,
            "checkpoint_level": level["level"], "checkpoint_interval_s": level["interval_s"],
            "checkpoint_overhead": level["overhead"], "snapshot_s": level["blocking_s"], "restart_base_s": base,
            "steps_lost_per_restart": level["interval_s"] / 2 / step_s if step_s else 0.0, "rebuild_s": rebuild,
            "redo_s": redo["seconds"], "recomputed_microbatches": redo["microbatches"],
            "takeover_s": takeover_s(plan), "supervisor_lost_s": supervisor_lost_s(plan, base, wait["node"])}


def snapshot_every(plan) -> dict:
    """The runtime's snapshot interval in steps (plan.json's blast_radius.snapshot): the config's
    training.checkpoint.snapshot_every, else the peer-memory interval the plan picks (module
    docstring) in whole steps, else 0 (the plan picks the file system: no snapshots)."""
    set_ = plan.spec.training.checkpoint.snapshot_every
    if set_ is not None:
        return {"every_steps": int(set_), "from": "training.checkpoint.snapshot_every"}
    g = goodput(plan) if plan.blast_radius and plan.blast_radius.get("checkpoint_interval_s") else {}
    step = plan.step.wall_s if plan.step is not None else 0.0
    if g.get("checkpoint_level") != "peer_memory" or not step or not math.isfinite(g["checkpoint_interval_s"]):
        return {"every_steps": 0, "from": f"the plan's checkpoint level ({g.get('checkpoint_level', 'none')})"}
    return {"every_steps": max(1, round(g["checkpoint_interval_s"] / step)),
            "from": "the plan's peer-memory interval (Young/Daly on the failures that restart)"}


def takeover_s(plan) -> float | None:
    """How long a standby supervisor takes to know the active one's node is gone: the lease timeout
    (failover.lease_s, plan/timeouts.lease_s; launch/lease.py). None where there is no standby: the
    local launcher (one machine) and a one-node SLURM job."""
    from orchestrator.plan.timeouts import lease_s

    if plan.spec.launcher.name.value != "slurm" or plan.spec.cluster.nodes < 2:
        return None
    return lease_s(plan.spec.failover, plan.spec.launcher.poll_s)


def supervisor_lost_s(plan, base_s: float, wait_s: float, detected_s: float | None = None) -> float:
    """What losing the supervisor's node costs, one definition for the plan and the simulation's replay
    (benchmarks/failover_sim.py, which passes the detection it drove through the real lease): with a
    standby, the lease timeout (or `detected_s`) and a restart from the checkpoint level in the same
    allocation (`base_s`: relaunched, the state read back, half an interval redone); without one, the
    failure's `wait_s`, the restart, and on SLURM the requeue (REQUEUE_S)."""
    t = takeover_s(plan)
    if t is None:
        return wait_s + base_s + (REQUEUE_S if plan.spec.launcher.name.value == "slurm" else 0.0)
    return (t if detected_s is None else float(detected_s)) + base_s

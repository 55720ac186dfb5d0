"""Failover in place: the decisions, for every launcher (the loop is supervisor.py's).

With several copies of the model state (layout.dp_shard < dp) a lost node takes down the
copies it held, and only those: the surviving copies keep their processes, parameters
and optimizer state, the coordinator (control.py) stops them at the step boundary, and
this policy decides the next generation:

- spare: a warm spare copy takes the lost copy's place; it receives the state from a
  healthy copy over the network, and DP stays as it was;
- in_place: no spare; the survivors go on with fewer copies and take the lost copies'
  micro-batches, so the global batch stays whole (split unevenly when they do not divide it);
- rejoin: a node that came back joins at a step boundary as a new copy; DP grows again.

Each decision is a new plan (RUN_DIR/attemptN/plan.json, the runtime reads it) and an
event in failover.json (mode, steps lost, recovery time, old and new layout, samples
reassigned). What cannot go on in place (one copy left below failover.min_dp, a global
batch the survivors cannot split under failover.batch_policy, experts spanning copies) is refused, and the loop
falls back to re-plan and restart, saying why.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch.control import Decision
from orchestrator.launch.failover import copies_short
from orchestrator.launch.status import read_metrics
from orchestrator.rundir import events
from orchestrator.report.artifacts import write_plan


def copy_size(plan) -> int:
    d = plan.layout
    return d.tp * d.cp * d.pp * d.dp_shard


class InPlace:
    """Decides each generation from the survivors and the waiting copies (coordinator thread)."""

    def __init__(self, plan, run_dir: Path, attempt: int, workers):
        self.plan, self.run_dir, self.attempt, self.workers = plan, Path(run_dir), attempt, workers
        self.initial_copies = plan.layout.dp_replicate
        self.lock = threading.Lock()
        self.detected: float | None = None  # wall time the supervisor saw the failure
        self.pending: dict | None = None  # the event waiting for its recovery time
        self.refused: str | None = None  # why the survivors cannot go on in place (the loop restarts)
        self.copies = list(range(self.initial_copies))  # the current generation's copies, in data order
        self.kept_at: int | None = None  # the step the last generation was formed at keeping the gradients

    def copies_alive_for(self, alive: int) -> str | None:
        """Can `alive` copies (with the spares waiting) go on? None if yes, else why not."""
        return copies_short(self.plan, alive, len(self.workers.waiting_spares()))

    def decide(self, alive: list[int], dead: list[int], joiners: list[int], step: int) -> Decision:
        with self.lock:
            spares = [c for c in joiners if c in self.workers.waiting_spares()]
            rejoins = [c for c in joiners if c not in spares]
            copies = list(alive) + spares[: len(dead)] + rejoins
            copies = copies[: max(self.initial_copies, len(alive))]
            mode = "spare" if dead and spares else "in_place" if dead else "rejoin"
            new = [c for c in copies if c not in alive]
            if not copies:
                return Decision(False, reason="no copy of the model state is left")
            plan, why = self._replan(len(copies))
            if plan is None:
                self._stop_event(alive, dead, step, why)
                return Decision(False, reason=why)
            self.attempt += 1
            plan_dir = rundir.attempt_dir(self.run_dir, self.attempt)
            write_plan(plan, plan_dir, figures=False)
            old, before = self.plan, self.copies
            self.plan, self.copies = plan, list(copies)
            self.workers.assign(copies, plan, plan_dir)
            # samples per step the lost copies read (their mean share when the split is uneven)
            lost_share = old.spec.training.global_batch * old.layout.dp_shard * len(dead) // old.layout.dp
            redo = keeps(old, plan, before, copies, step, self.kept_at)
            self.kept_at = step if redo["path"] == "kept" else None
            self.pending = events.record(self.run_dir, {
                "mode": mode, "attempt": self.attempt, "step": step, "copies_lost": dead, "copies_new": new,
                "nodes_lost": self.workers.lost_nodes(), "old_layout": _layout(old), "new_layout": _layout(plan),
                "failed_during_step": step, "steps_lost": 0, "steps_redone": 1 if dead else 0,
                # the step in flight: finished from the survivors' gradients, only the lost copies' micro-batches
                # recomputed (kept), or redone whole (step: why in redo_why); what every data rank recomputed
                "redo": redo["path"], "redo_why": redo["why"], "microbatches_recomputed": redo["lost"],
                "microbatches_recomputed_per_rank": redo["per_rank"],
                "samples_reassigned_per_step": lost_share if mode == "in_place" else 0,
                "detected_at": self.detected if dead else None, "decided_at": time.time(), "recovery_s": None,
                # how the survivors left their pending cross-copy collectives: aborted by the coordinator the
                # moment the loss was known, or they found out themselves (a connection reset, a timeout)
                "survivors_released": ("abort" if self._aborted() else "found out") if dead else None})
            self.detected = None
            self.workers.say(f"FAILOVER ({mode}): copies {dead} lost, {new} new; generation with copies {copies}: "
                             f"{old.layout.label()} -> {plan.layout.label()}, going on at step {step} "
                             f"(0 steps lost)" if dead else
                             f"REJOIN: copies {new} join at step {step}: {old.layout.label()} -> {plan.layout.label()}")
            return Decision(True, str(plan_dir), copies, new=new, keep=redo["path"] == "kept")

    def _aborted(self) -> dict | None:
        """The coordinator's abort of the change being decided (launch/control.py), if there was one."""
        services = getattr(self.workers, "services", None)
        coord = getattr(self.workers, "coordinator", None) or getattr(services, "coordinator", None)
        return getattr(coord, "aborted", None)

    def _replan(self, copies: int):
        """The plan of `copies` copies: the same TP, CP, PP and dp_shard, the global batch kept
        (split unevenly over the copies when they do not divide it): plan/replan.py replan_with."""
        from orchestrator.plan.replan import replan_with

        old, gpn = self.plan.layout, self.plan.spec.hardware.gpus_per_node
        dp = copies * old.dp_shard
        ranks = dp * old.tp * old.cp * old.pp
        if ranks % gpn:
            return None, f"{copies} copies of {copy_size(self.plan)} ranks do not fill whole nodes of {gpn}"
        _, plan, _, why = replan_with(self.plan, dp, ranks // gpn, old.dp_shard)
        return (plan, None) if why is None else (None, f"no plan for {copies} copies: {why}")

    def _stop_event(self, alive, dead, step, why) -> None:
        self.refused = why
        events.record(self.run_dir, {"mode": "in_place_refused", "copies_alive": alive, "copies_lost": dead,
                                     "step": step, "reason": why})
        self.workers.say(f"cannot go on in place: {why}; falling back to re-plan and restart")

    def poll(self) -> None:
        """Once the new generation completed a step: the failover's recovery time."""
        with self.lock:
            if self.pending is None:
                return
            done = [m for m in read_metrics(self.run_dir) if m.get("attempt") == self.attempt]
            if not done:
                return
            first = min(done, key=lambda m: m["time"])
            since = self.pending.get("detected_at") or self.pending["decided_at"]
            events.amend(self.run_dir, self.pending["time"], {"recovery_s": first["time"] - since,
                                                              "first_step_after": first["step"]})
            self.workers.say(f"recovered in {first['time'] - since:.2f} s (failure detected -> step "
                             f"{first['step'] + 1} completed)")
            self.pending = None


INSIDE_COPY = ("tp", "cp", "pp", "dp_shard", "vp")  # what the kept gradients' shards are shaped by


def keeps(old, new, before: list[int], after: list[int], step: int, kept_at: int | None) -> dict:
    """How the new generation finishes the step in flight (one rule: the runtime reads `keep` from the
    coordinator's answer). Kept: the survivors' gradients hold the old generation's split of `step`,
    and the lost copies' micro-batches (plan/split.py) are recomputed over the new generation's data
    ranks. The whole step is redone when the copy's layout changed (the gradients' shards would not
    fit), the batch's cut changed, or the old generation was itself finishing `step` from kept
    gradients (a second loss before it committed: who held which micro-batch is no longer one split).
    {path: kept | step, why, lost: micro-batches recomputed, per_rank: the most a data rank runs}."""
    from orchestrator.plan.split import lost_microbatches, recompute_run

    o, n = old.layout, new.layout
    changed = [k for k in INSIDE_COPY if getattr(o, k) != getattr(n, k)]
    tr_o, tr_n = old.spec.training, new.spec.training
    why = ""
    if changed:
        why = "the copy's layout changed (" + ", ".join(f"{k} {getattr(o, k)} -> {getattr(n, k)}" for k in changed) + ")"
    elif (tr_o.global_batch, tr_o.micro_batch) != (tr_n.global_batch, tr_n.micro_batch):
        why = "the batch's cut changed"
    elif kept_at == step:
        why = f"a second change before step {step} committed"
    M = tr_o.global_batch // tr_o.micro_batch
    if why:
        return {"path": "step", "why": why, "lost": M, "per_rank": n.microbatches}
    lost = lost_microbatches(M, o.dp, o.dp_shard, [i for i, c in enumerate(before) if c not in after])
    runs = [recompute_run(len(lost), n.dp, n.dp_shard, i) for i in range(len(after))]
    return {"path": "kept", "why": "", "lost": len(lost), "per_rank": max(runs, default=0)}


def _layout(plan) -> dict:
    d = plan.layout
    return {"nodes": plan.spec.cluster.nodes, "tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp,
            "dp_shard": d.dp_shard, "microbatches": d.microbatches, "micro_batch": plan.spec.training.micro_batch,
            "label": d.label()}

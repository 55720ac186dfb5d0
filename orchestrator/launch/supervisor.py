"""The one failover loop: start the ranks, follow them, and when nodes are lost re-plan on
the survivors and start again. Every launcher that owns its ranks runs it: the local
launcher in the `orchestrate` process, the SLURM launcher inside the job's allocation.

What starts and watches the ranks is a `Workers` implementation (processes on this
machine, or srun steps in an allocation); this loop only decides. Each failover is an
event in failover.json and TensorBoard, and status.json says where the run stands.
"""
from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import EXIT_INCOMPLETE, EXIT_STOPPED
from orchestrator.rundir import events
from orchestrator.launch.manifest import record_attempt
from orchestrator.launch import failover
from orchestrator.launch.failover import Failure
from orchestrator.plan.replan import why_not_in_place
from orchestrator.launch.inplace import InPlace
from orchestrator.launch.status import steps_completed, write_status
from orchestrator.rundir import checkpoints as ckpt
from orchestrator.report.artifacts import write_plan
from orchestrator.plan.replan import replan_on_survivors
from orchestrator.frameworks.trainers import external  # other trainers restart (inplace.why_not_in_place)


@dataclass
class Outcome:
    ok: bool
    lost: list = field(default_factory=list)  # nodes that died (empty: the ranks failed on their own)
    cause: str = ""
    detected_s: float | None = None  # seconds from the failure to its detection, when known
    stopped: bool = False  # every rank saved and stopped on request (preemption, time limit)
    crashed: bool = False  # a rank failed with an error on a node that stays up (a fault, until it repeats)
    error: str | None = None  # what the crashed rank said last (its log's last error line)
    drained: list = field(default_factory=list)  # nodes SLURM drained (left out, not counted as failures)

    def failures(self) -> list[Failure]:
        """What failed, as the decision (launch/failover.py) reads it."""
        out = [Failure(n, failover.NODE_LOST, self.cause) for n in self.lost]
        out += [Failure(n, failover.DRAINED, f"node {n} drained") for n in self.drained if n not in self.lost]
        if self.crashed:
            out.append(Failure(None, failover.CRASH, self.cause, self.error))
        return out


class Workers(ABC):
    """Starts the ranks of one attempt on a list of nodes and reports how they ended: processes
    here (launch/local.LocalWorkers) or srun steps in an allocation (launch/srun.SrunWorkers).
    What failed is decided in one place (launch/failover.decide); the workers only see and act.
    The in-place policy (launch/inplace.InPlace) calls the methods below the abstract ones."""

    current: list = []  # the nodes the running attempt uses, in the plan's order
    fenced: bool = False  # a standby took the run's lease (launch/lease.py): stop, decide and write nothing

    @abstractmethod
    def nodes(self) -> list:
        """The allocation's nodes, in rank order."""

    @abstractmethod
    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict, policy=None) -> list:
        """Start the attempt's ranks on the first nodes the plan needs (the rest wait as spares)
        and return the nodes it uses. With a `policy` (several copies of the state) also run the
        job's store and coordinator, and let lost copies drop out in place as the policy decides."""

    @abstractmethod
    def wait(self) -> Outcome:
        """Block until every rank has ended, or nodes are lost (then stop the rest): failures seen
        within one settle window (plan/timeouts.settle_s) come back as one Outcome. Bounded: every
        wait inside has a deadline."""

    @abstractmethod
    def stop(self) -> None:
        """Kill every rank of the attempt and close its services."""

    def say(self, text: str) -> None:
        print(text, flush=True)

    def waiting_spares(self) -> set[int]:
        """Copies waiting warm to take a lost copy's place."""
        return set()

    def lost_nodes(self) -> list:
        """Every node lost so far in this run."""
        return []

    def assign(self, copies: list[int], plan, plan_dir: Path) -> None:
        """A generation was decided in place (these copies, this plan): the spares it took are spares no more."""

    def resume_point(self, url: str, done: int) -> dict:
        """Where a restart after `done` steps resumes: {"source": "checkpoint" | "snapshot", "step"}
        (workers that keep memory snapshots, train/keeper.py, may offer a newer one than the checkpoint)."""
        return {"source": "checkpoint", "step": ckpt.latest_complete(url) or 0}


def layout_of(plan, nodes: int) -> dict:
    d = plan.layout
    return {"nodes": nodes, "tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "ep": d.ep,
            "microbatches": d.microbatches, "label": d.label()}




def supervise(plan, run_dir: Path, workers: Workers, say=print, first_attempt: int = 0) -> int:
    """Run to the end, re-planning on the survivors after every lost node (failover.*).
    `first_attempt` continues the numbering of a run that an earlier job started."""
    run_dir = Path(run_dir)
    spec = plan.spec
    url = ckpt.url_for(spec.training.checkpoint.dir, run_dir)
    # every healthy node: the plan's nodes first, then those waiting (spares, and the nodes a re-plan
    # left over: whole replicas did not fit on them). Each re-plan sees the whole pool.
    alive = workers.nodes()
    attempt, failovers = first_attempt, len([e for e in events.read_events(run_dir) if e.get("mode") == "restart"])
    while True:
        if workers.fenced:  # a successor supervises the run now (launch/lease.py): step down, write nothing
            return rundir.EXIT_FENCED
        plan_dir = rundir.attempt_dir(run_dir, attempt)
        if attempt:
            write_plan(plan, plan_dir, figures=False)
        write_status(run_dir, state="running", attempt=attempt, next_attempt=attempt + 1, layout=plan.layout.label(),
                     nodes=alive, plan_dir=str(plan_dir),
                     message=f"attempt {attempt} training on {plan.spec.cluster.nodes} node(s) as {plan.layout.label()}"
                             + (f", after {failovers} restart(s)" if failovers else ""))
        t_start = time.monotonic()
        policy = InPlace(plan, run_dir, attempt, workers) if plan.layout.dp_replicate > 1 and not external(plan) else None
        # with copies of the state the waiting nodes are warm spares; with one copy they wait idle
        start_on = alive if policy is not None else alive[: plan.spec.cluster.nodes]
        used = workers.start(attempt, plan_dir, start_on, {rundir.ENV_RUN_DIR: str(run_dir),
                                                           rundir.ENV_ATTEMPT: str(attempt)}, policy)
        record_attempt(run_dir, attempt, plan_dir, used or start_on)
        outcome = workers.wait()
        if workers.fenced:
            return rundir.EXIT_FENCED
        if policy is not None:  # generations decided in place moved the plan on
            plan, attempt = policy.plan, policy.attempt
            write_status(run_dir, next_attempt=attempt + 1)
        if outcome.ok:
            missing = _missing_steps(run_dir, spec.training.steps, attempt)
            if missing:  # every rank ended, but not at the last step: never say it finished
                write_status(run_dir, state="failed", message=missing)
                say(f"\nFAILED: {missing}", file=sys.stderr)
                return EXIT_INCOMPLETE
            write_status(run_dir, state="completed", message=f"finished all {spec.training.steps} steps after "
                         f"{failovers} restart(s) and {_in_place_count(run_dir)} in-place failover(s)")
            _measured(run_dir, say)
            return rundir.EXIT_OK
        if outcome.stopped:
            write_status(run_dir, state="stopped", message=outcome.cause)
            return EXIT_STOPPED
        t_fail = time.monotonic()
        if not outcome.lost and not outcome.crashed and not outcome.drained:
            write_status(run_dir, state="failed", message=outcome.cause)
            say(f"\nFAILED: {outcome.cause}", file=sys.stderr)
            return rundir.EXIT_FAILED
        what = (f"node(s) {outcome.lost} lost" if outcome.lost else "a rank crashed (its node stays in service)"
                if outcome.crashed else f"node(s) {outcome.drained} drained")
        say(f"\nFAILURE: {outcome.cause}; {what}", file=sys.stderr, flush=True)
        done = steps_completed(run_dir, range(attempt + 1))
        verdict = failover.decide(outcome.failures(), plan, history=events.read_events(run_dir), steps_done=done)
        if verdict.action == "stop":
            why = verdict.reason.split("STOPPED: ", 1)[-1]
            events.record(run_dir, {"mode": "stopped", "nodes_lost": outcome.lost, "cause": outcome.cause,
                                    "error": outcome.error, "failed_after_step": done, "reasons": [why]})
            write_status(run_dir, state="failed", message=f"{what}: {outcome.cause}; STOPPED: {why}")
            say(f"STOPPED: {why}; {failovers} restart(s) so far.", file=sys.stderr)
            return verdict.exit_code
        survivors = [n for n in alive if n not in verdict.excluded]  # lost, drained, flapping: none relaunched
        # (the whole healthy pool: nodes in service and those left waiting by an earlier re-plan)
        t0 = time.monotonic()
        write_status(run_dir, state="re-forming", message=what)
        rp = replan_on_survivors(plan, len(survivors))
        replan_s = time.monotonic() - t0
        if rp.plan is None:
            events.record(run_dir, {"mode": "stopped", "nodes_lost": outcome.lost, "reasons": rp.problems})
            write_status(run_dir, state="failed", message="no layout fits the survivors: " + "; ".join(rp.problems))
            say(f"STOPPED: no layout fits the {len(survivors)} surviving node(s): " + "; ".join(rp.problems),
                file=sys.stderr)
            return rundir.EXIT_FAILED
        failovers += 1
        _record_restart(run_dir, workers.resume_point(url, done), plan, rp, outcome, verdict, attempt, alive, survivors,
                        done, failovers, what,
                        {"detection": outcome.detected_s, "replan": replan_s, "run_before_failure": t_fail - t_start},
                        say)
        alive, plan, attempt = survivors, rp.plan, attempt + 1  # the nodes left over wait in the pool


def _record_restart(run_dir, point, plan, rp, outcome, verdict, attempt, alive, survivors, done, failovers, what,
                    seconds, say) -> None:
    """The restart's event in failover.json, and its line on the console. `point`: where it resumes
    (Workers.resume_point: a checkpoint, or a memory snapshot)."""
    why = why_not_in_place(plan) or "the survivors could not go on in place (failover.json)"
    resume_from = point["step"]
    event = events.record(run_dir, {
        "mode": "restart", "attempt": attempt, "node": (outcome.lost or [None])[0], "nodes_lost": outcome.lost,
        "cause": outcome.cause, "kind": "crash_rank" if outcome.crashed else "node_lost", "error": outcome.error,
        "old_layout": layout_of(plan, plan.spec.cluster.nodes), "new_layout": layout_of(rp.plan, rp.nodes),
        "spare_gpus": rp.spare_gpus, "changes": rp.changes, "failed_after_step": done,
        "resumed_from_step": resume_from, "resumed_from": point["source"], "steps_lost": max(done - resume_from, 0),
        **({"snapshot_not_used": point["why"]} if point.get("why") else {}),
        "nodes_in_service": survivors[: rp.nodes], "nodes_waiting": survivors[rp.nodes:],
        "healthy_nodes": len(survivors), "why_not_in_place": why, "seconds": seconds,
        "nodes_drained": outcome.drained, "nodes_excluded": verdict.excluded, "counted": verdict.counted,
        "decision": verdict.reason})
    say(f"FAILOVER {failovers} (restart, {why}): {what} after step {done}; re-planned on {rp.nodes} "
        f"node(s): {', '.join(rp.changes)}; spares {rp.spare_gpus} GPU(s); resuming from step "
        f"{event['resumed_from_step']} ({'a memory snapshot' if point['source'] == 'snapshot' else 'the checkpoint'}; "
        f"{event['steps_lost']} step(s) lost)", flush=True)


def _missing_steps(run_dir: Path, steps: int, attempt: int) -> str | None:
    """Why a run whose ranks all ended well is not complete (None: every step ran). A runtime
    that keeps no metrics.jsonl (an external trainer) is taken at its word."""
    if not (Path(run_dir) / rundir.METRICS_JSONL).exists():
        return None
    done = steps_completed(run_dir, range(attempt + 1))
    if done >= steps:
        return None
    return (f"every rank ended, but only {done} of training.steps={steps} steps completed ({steps - done} "
            f"missing); see failover.json and the logs")


def _in_place_count(run_dir: Path) -> int:
    return len([e for e in events.read_events(run_dir) if e.get("mode") in ("in_place", "spare")])


def _measured(run_dir: Path, say) -> None:
    """plan.md and step_budget.png gain the measured step beside the predicted one."""
    from orchestrator.report.artifacts import write_measured

    try:
        m = write_measured(run_dir)
    except (OSError, ValueError, KeyError) as e:  # a run without usable metrics: say so, do not fail the run
        say(f"measured-vs-predicted not written: {type(e).__name__}: {e}")
        return
    if m:
        say(m["line"])

"""Every failover decision, for every launcher: what was lost -> go on in place (or with a
spare), re-plan and restart, or stop, with the reason. Torch-free and free of processes and
sockets: the local launcher (launch/local.py), the SLURM supervisor (launch/srun.py), the
failover loop (launch/supervisor.py) and the simulation (benchmarks/failover_sim.py) call
the same functions with what they saw.

    decide(failures, plan, copies_alive=None, spares=0, history=(), steps_done=0) -> Verdict

- `failures`: the `Failure`s gathered within one settle window (`settle_s`): two nodes lost
  at once are one decision, not two restarts.
- `plan`: the plan running (its layout and `failover.*`).
- `copies_alive`: with several copies of the model state, how many survive the failures
  (None: one copy, or not known: in place is not considered).
- `spares`: warm spare copies waiting.
- `history`: failover.json's events so far (the budget, the same-error rule, flapping nodes).
- `steps_done`: steps completed when the failure happened.

Node states come from SLURM (`parse_sinfo` reads `sinfo -h -N -o "%N|%T|%E"`): DOWN,
NOT_RESPONDING, FAIL (and a trailing `*`, not responding) are a lost node; DRAIN, DRAINING,
DRAINED are an admin taking the node out: it is excluded from every later launch and not
counted against the failure budget. A node that failed FLAP_FAILURES times within
FLAP_WINDOW_S (it came back and failed again) is flapping: excluded from later launches
(`excluded_nodes`) even when SLURM returns it to service.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.plan.replan import why_not_in_place


# ---- failures and node states -------------------------------------------------------------
NODE_LOST, CRASH, HANG, DRAINED = "node_lost", "crash", "hang", "drained"
DOWN_STATES = ("DOWN", "NOT_RESPONDING", "NO_RESPOND", "FAIL", "FAILING", "POWER_DOWN", "POWERED_DOWN")
DRAIN_STATES = ("DRAIN", "DRAINING", "DRAINED")
FLAP_FAILURES, FLAP_WINDOW_S = 2, 3600.0  # failed this many times within the window: flapping


@dataclass(frozen=True)
class Failure:
    node: object  # the node (its name on SLURM, its index locally)
    kind: str = NODE_LOST  # NODE_LOST | CRASH (a rank failed, its node stays up) | HANG | DRAINED
    cause: str = ""  # said plainly
    error: str | None = None  # a crashed rank's last error line (tells a repeated bug from a fault)


@dataclass
class Verdict:
    """What to do about the failures seen together."""

    action: str  # "in_place" | "spare" | "restart" | "stop" | "continue" (nothing to recover)
    reason: str
    lost: list = field(default_factory=list)  # nodes lost (counted against the failure budget)
    excluded: list = field(default_factory=list)  # nodes left out of every later launch (lost, drained, flapping)
    counted: bool = True  # whether it counts against failover.max_failovers(_per_hour)
    exit_code: int = 0  # for "stop": the process's exit status


def node_state(state: str, reason: str = "") -> str:
    """NODE_LOST, DRAINED or "up" for a SLURM node state (sinfo %T, scontrol State=) and reason."""
    words = {w for w in state.upper().rstrip("*~#!%$@^-").replace("+", " ").split()}
    if state.endswith("*") or words & set(DOWN_STATES):
        return NODE_LOST
    if words & set(DRAIN_STATES):
        return DRAINED
    return "up"


def parse_sinfo(text: str) -> dict[str, tuple[str, str]]:
    """`sinfo -h -N -o "%N|%T|%E"` -> {node: (state, reason)} (a node listed twice, once per
    partition, is read once)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[0]:
            out.setdefault(parts[0], (parts[1], parts[2] if len(parts) > 2 else ""))
    return out


def failures_from_states(states: dict[str, tuple[str, str]], nodes, known=()) -> list[Failure]:
    """The nodes of `nodes` SLURM reports lost or drained (leaving out those in `known`)."""
    out = []
    for n in nodes:
        if n in known or n not in states:
            continue
        st, reason = states[n]
        kind = node_state(st, reason)
        if kind != "up":
            out.append(Failure(n, kind, f"node {n} is {st}" + (f" ({reason})" if reason and reason != "none" else "")))
    return out


def flapping(history, now: float | None = None) -> list:
    """Nodes lost FLAP_FAILURES times or more within FLAP_WINDOW_S (each restart or in-place event
    names the nodes it lost): they came back and failed again."""
    now = time.time() if now is None else now
    count: dict = {}
    for e in history:
        if e.get("mode") in ("restart", "in_place", "spare") and now - e.get("time", now) <= FLAP_WINDOW_S:
            for n in e.get("nodes_lost") or []:
                count[n] = count.get(n, 0) + 1
    return sorted((n for n, c in count.items() if c >= FLAP_FAILURES), key=str)


def excluded_nodes(history, now: float | None = None) -> list:
    """Every node no later launch may use: drained ones and flapping ones (failover.json)."""
    drained = {n for e in history for n in e.get("nodes_drained") or []}
    return sorted(drained | set(flapping(history, now)), key=str)


# ---- in place (why_not_in_place: plan/replan.py, which the plan's goodput reads too) ---------


def copies_short(plan, alive: int, spares: int = 0) -> str | None:
    """Can `alive` copies (with `spares` waiting) go on? None if yes, else why not."""
    need = max(plan.spec.failover.min_dp, 1)
    if alive + spares < need:
        return f"{alive} copy(ies) left, below failover.min_dp={plan.spec.failover.min_dp}"
    return None


# ---- the decision ----------------------------------------------------------------------------
def decide(failures: list[Failure], plan, copies_alive: int | None = None, spares: int = 0, history=(),
           steps_done: int = 0, now: float | None = None) -> Verdict:
    """The one decision for failures seen together (module docstring)."""
    from orchestrator.rundir import EXIT_FAILED, EXIT_NO_PROGRESS

    now = time.time() if now is None else now
    flaps = set(flapping(history, now))
    drained = _unique(f.node for f in failures if f.kind == DRAINED)
    lost = _unique(f.node for f in failures if f.kind in (NODE_LOST, HANG) and f.node not in drained)
    crashed = [f for f in failures if f.kind == CRASH]
    excluded = _unique([*lost, *drained, *(n for f in failures if (n := f.node) in flaps)])
    what = "; ".join(f.cause for f in failures if f.cause) or "a failure"
    if not lost and not crashed:
        if not drained:
            return Verdict("continue", "nothing failed")
        return Verdict("continue", f"{what}: drained by SLURM, left out of every later launch and not counted "
                       f"as a failure", [], excluded, counted=False)
    flapped = [n for n in lost if n in flaps]
    if flapped:
        what += f"; node(s) {flapped} failed {FLAP_FAILURES} times within {FLAP_WINDOW_S:.0f} s (flapping): excluded"
    if copies_alive is not None:
        why = why_not_in_place(plan) or copies_short(plan, copies_alive, spares)
        if why is None:
            mode = "spare" if spares else "in_place"
            return Verdict(mode, f"{what}; the surviving copies go on {'with a spare' if spares else 'in place'}",
                           lost, excluded)
    else:
        why = why_not_in_place(plan)
    stop = why_stop(plan, history, steps_done, crashed[0].error if crashed and not lost else None, now)
    if stop is not None:
        reason, code = stop
        return Verdict("stop", f"{what}; STOPPED: {reason}", lost, excluded,
                       exit_code=EXIT_NO_PROGRESS if code == "no_progress" else EXIT_FAILED)
    return Verdict("restart", f"{what}; re-plan and restart ({why or 'not in place'})", lost, excluded)


BUDGET_MODES = ("restart", "supervisor_takeover")  # failover.json events that count against the failure budget


def over_budget(plan, history, now: float | None = None) -> str | None:
    """Why one more restart of the ranks exceeds failover.max_failovers(_per_hour) (None: it does
    not): what a standby asks before it takes over (launch/batch.take_over)."""
    fo, now = plan.spec.failover, time.time() if now is None else now
    counted = [e for e in history if e.get("mode") in BUDGET_MODES and e.get("counted", True)]
    if fo.max_failovers is not None and len(counted) >= fo.max_failovers:
        return f"failover.max_failovers={fo.max_failovers} reached"
    rate, derived = budget_per_hour(plan)
    recent = [e for e in counted if e.get("time", 0.0) > now - 3600]
    if len(recent) >= rate:
        return f"{len(recent)} restarts in the last hour reach failover.max_failovers_per_hour={rate:g}{derived}"
    return None


def why_stop(plan, history, done: int, error: str | None = None, now: float | None = None) -> tuple[str, str] | None:
    """Why one more restart is refused (reason, "failed" | "no_progress"), or None. A crash with
    the same error at the same step as an earlier one is a bug in the code or the config, not a
    fault. Restarts caused only by drained nodes do not count against the budget."""
    fo = plan.spec.failover
    now = time.time() if now is None else now
    past = [e for e in history if e.get("mode") == "restart"]
    if not fo.enabled:
        return "failover is off (failover.enabled=false)", "failed"
    if error is not None and any(e.get("error") == error and e.get("failed_after_step") == done for e in past):
        return (f"the same error at step {done} twice, so a bug in the code or the config, not a fault: "
                f"{error}"), "failed"
    budget = over_budget(plan, history, now)  # every restart of the ranks: a standby's takeover too
    if budget is not None:
        return budget, "failed"
    same = 1
    for e in reversed(past):
        if e.get("failed_after_step") != done:
            break
        same += 1
    if same >= fo.no_progress_attempts:
        return (f"no progress: {same} attempts in a row failed after step {done} "
                f"(failover.no_progress_attempts={fo.no_progress_attempts})"), "no_progress"
    return None


def budget_per_hour(plan) -> tuple[float, str]:
    """failover.max_failovers_per_hour, or 4 x the plan's expected failures per hour (at least 3)."""
    fo = plan.spec.failover
    if fo.max_failovers_per_hour:
        return float(fo.max_failovers_per_hour), ""
    mtbf = (plan.blast_radius or {}).get("job_mtbf_hours") or float("inf")
    return max(3.0, 4.0 / mtbf), f" (4 x the job MTBF of {mtbf:.2g} h, at least 3)"


def _unique(xs) -> list:
    out = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out

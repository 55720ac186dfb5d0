"""The failover timeouts, ordered and derived from the plan's predicted step and checkpoint save
(plan.md prints the ladder; plan.json holds it as blast_radius.timeouts). Torch-free.

    settle window W  <  quorum Q  <  collective timeout C        and   stall S  <=  hang deadline D  <  C

A loss that is known is not waited for: when the supervisor or the coordinator knows a copy is
lost (SLURM says its node is down, its leader's connection closed, its rank exited, its ranks
stalled past S or D) the coordinator aborts the survivors' pending cross-copy collectives at
once (launch/control.py `abort`, train/replicas.py) and they go on in place. C is the last
resort, for a loss nobody noticed (a peer cut off that still beats).

- D, the hang deadline (failover.progress_deadline_s): no rank made progress for this long ->
  the rank furthest behind is named and its node lost. DEADLINE_FACTOR x (predicted step +
  save), at least DEADLINE_FLOOR_S. Below C, so a hang is named before a collective gives up.
- S, the stall deadline: a rank that has not reached the cross-copy collective while the
  ranks waiting in it have waited this long (their beats say so: train/world.py, phase `wait`)
  is the one that stopped; it is named and its node lost. STALL_FACTOR x (predicted step +
  save), at least STALL_FLOOR_S, at most D. The others wait on a straggler (f - 1) x its step:
  one up to twice as slow stays below it.
- K, the control connection's keepalive (keepalive_s, stated: KEEPALIVE_*): a copy leader's
  connection to the coordinator that goes unanswered this long (a node cut off, a dead machine
  that sent no reset) errors, and the coordinator reads it as the copy lost (launch/control.py
  `closed`), then aborts. It catches a partition only where the control connection shares the
  cut path; a peer cut off from the collective's network alone is the collective timeout's.
- B, the cross-copy collective's bound (collective_bound_s): once every rank of the job is in a
  step's cross-copy collective (their beats say `wait`, the last came B ago) and no copy has
  committed the step, the collective is not slow but cut (a copy cut off on the data path while
  its leader's control connection is up: K does not see it, and every rank waits, so neither S
  nor D names anyone): the coordinator aborts the generation and the copies re-form, without
  the copy the others could not reach (launch/control.py `in_collective`). BOUND_FACTOR x the
  plan's predicted cross-copy collective (the dp and edp axes' whole time, hidden or not), at
  least BOUND_FLOOR_S, at most C / 2. A straggler does not start it (the last copy to enter
  does), and a collective that is slow by less than the factor completes within it.
- L, the supervisor's lease (failover.lease_s; lease_s): on SLURM with more than one node a
  standby supervisor takes over, in the same allocation, when the active one has not renewed its
  lease in the run directory for L (launch/lease.py, launch/standby.py); it is renewed every
  L / LEASE_RENEWALS. Apart from the ladder below: it guards the supervisor, not the ranks.
- W, the settle window (settle_s): failures seen within it after the first are
  one recovery (two nodes lost at once re-plan once). SETTLE_FRACTION of D, 1 .. 30 s.
- Q, the quorum (failover.quorum_s): after the first copy reports a failure the coordinator
  waits this long for the others before deciding without them (counted from the first report,
  launch/control.py). Above W, so the copies hit by failures of one moment are decided
  together; default max(QUORUM_FLOOR_S, 2 W).
- C, the cross-copy collective timeout (failover.timeout_s): gloo gives up on a silent peer.
  Default max(COLLECTIVE_FLOOR_S, 2 D, 2 Q).

On SLURM a node whose ranks died is confirmed lost once SLURM marks it down (at most
launcher.node_fail_wait_s, SlurmdTimeout + 30 s by default: node_confirm_s): that confirms, it
does not detect. The SLURM supervisor (launch/srun.py) gathers the failures SLURM reports within
the same settle window W (`from_plan`: the ladder plan.json holds), so plan.md's W is the one used.
"""
from __future__ import annotations

from orchestrator.config.errors import Problem

DEADLINE_FACTOR = 10.0
DEADLINE_FLOOR_S = 30.0
STALL_FACTOR, STALL_FLOOR_S = 1.0, 20.0
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 2, 3  # TCP keepalive of the control connections


def keepalive_s() -> float:
    """K: an unanswered control connection errors after the idle time and every probe unanswered."""
    return float(KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT)


def keep_alive(sock) -> None:
    """TCP keepalive (and an unacknowledged-data timeout) at K on a control connection, where the
    platform has them (train/control_server.py, train/wire.py)."""
    import socket

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", int(1000 * keepalive_s()))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
BOUND_FACTOR, BOUND_FLOOR_S = 10.0, 10.0  # B: the cross-copy collective's bound once every rank is in it


def collective_bound_s(collective_s: float, collective_c: float, fo=None) -> float:
    """B: how long every rank may wait in a step's cross-copy collective with no copy committing it
    (failover.collective_bound_s when set; else from `collective_s`, the plan's predicted time of
    that collective, and `collective_c`, C)."""
    if fo is not None and getattr(fo, "collective_bound_s", None) is not None:
        return float(fo.collective_bound_s)
    return min(float(collective_c) / 2, max(BOUND_FLOOR_S, BOUND_FACTOR * float(collective_s or 0.0)))


def cross_copy_s(axes) -> float:
    """The plan's predicted gradient collective over the data-parallel groups a step (axes dp and
    edp, plan.json `axes` dicts or cost.AxisReport objects): what the cross-copy wait holds."""
    get = (lambda a, k: a.get(k)) if axes and isinstance(axes[0], dict) else getattr
    return sum(float(get(a, "seconds") or 0.0) for a in axes or () if get(a, "name") in ("dp", "edp"))


SETTLE_FRACTION, SETTLE_MIN_S, SETTLE_MAX_S = 0.05, 1.0, 30.0
QUORUM_FLOOR_S = 10.0
COLLECTIVE_FLOOR_S = 60.0
SLURMD_TIMEOUT_S = 300.0  # SLURM's default SlurmdTimeout (a cluster's own is read from scontrol at run time)
NODE_FAIL_MARGIN_S, NODE_FAIL_FLOOR_S = 30.0, 60.0  # launcher.node_fail_wait_s: SlurmdTimeout + 30 s, at least 60 s


def node_confirm_s(lc, slurmd_timeout_s: float | None = None) -> float:
    """How long SLURM may take to mark a dead node down: launcher.node_fail_wait_s, or
    SlurmdTimeout (the cluster's when known, else SLURM's default) + NODE_FAIL_MARGIN_S."""
    if lc.node_fail_wait_s is not None:
        return float(lc.node_fail_wait_s)
    timeout = SLURMD_TIMEOUT_S if slurmd_timeout_s is None else float(slurmd_timeout_s)
    return max(NODE_FAIL_FLOOR_S, timeout + NODE_FAIL_MARGIN_S)


LEASE_FLOOR_S, LEASE_RENEWALS = 15.0, 5  # the supervisor's lease: its timeout's floor; renewals per timeout


def lease_s(fo, poll_s: float = 0.0) -> float:
    """L: the supervisor's lease timeout (failover.lease_s, or at least LEASE_FLOOR_S and
    LEASE_RENEWALS looks of the supervisor, launcher.poll_s): a standby takes over after it."""
    if fo.lease_s is not None:
        return float(fo.lease_s)
    return max(LEASE_FLOOR_S, LEASE_RENEWALS * float(poll_s or 0.0))


def lease_period_s(lease: float) -> float:
    """How often the active supervisor renews its lease: LEASE_RENEWALS times per timeout."""
    return float(lease) / LEASE_RENEWALS


def detection_s(step_s: float, save_s: float, fo) -> float:
    """D: how long the job may go without any rank making progress."""
    if fo.progress_deadline_s:
        return float(fo.progress_deadline_s)
    return max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * (float(step_s or 0.0) + float(save_s or 0.0)))


def stall_s(step_s: float, save_s: float, detection: float) -> float:
    """S: how long the ranks waiting in a cross-copy collective wait on one that has not come."""
    return min(float(detection), max(STALL_FLOOR_S, STALL_FACTOR * (float(step_s or 0.0) + float(save_s or 0.0))))


def settle_s(detection: float) -> float:
    """W: how long to keep gathering failures after the first before deciding."""
    return min(SETTLE_MAX_S, max(SETTLE_MIN_S, SETTLE_FRACTION * float(detection)))


def ladder(fo, step_s: float, save_s: float) -> dict:
    """Every timeout of the ladder in seconds (failover.* set, or derived)."""
    d = detection_s(step_s, save_s, fo)
    w = settle_s(d)
    q = float(fo.quorum_s) if fo.quorum_s is not None else max(QUORUM_FLOOR_S, 2 * w)
    c = float(fo.timeout_s) if fo.timeout_s is not None else max(COLLECTIVE_FLOOR_S, 2 * d, 2 * q)
    return {"hang_deadline_s": d, "stall_s": stall_s(step_s, save_s, d), "keepalive_s": keepalive_s(),
            "settle_s": w, "quorum_s": q,
            "collective_s": c,
            "derived": [k for k, v in (("progress_deadline_s", fo.progress_deadline_s), ("quorum_s", fo.quorum_s),
                                       ("timeout_s", fo.timeout_s)) if v is None]}


def from_plan(plan: dict, fo) -> dict:
    """The ladder a plan.json dict holds (blast_radius.timeouts), or derived from its predicted
    step and save when it holds none: what the launchers wait by, as plan.md prints it."""
    t = (plan.get("blast_radius") or {}).get("timeouts")
    if not (t and "stall_s" in t and "keepalive_s" in t):
        t = ladder(fo, float(plan.get("step", {}).get("wall_s") or 0.0),
                   float((plan.get("blast_radius") or {}).get("checkpoint_seconds") or 0.0))
    if "collective_bound_s" not in t:  # a plan written before the bound
        t = {**t, "collective_bound_s": collective_bound_s(cross_copy_s(plan.get("axes")), t["collective_s"], fo)}
    return t


def problems(fo, t: dict) -> list[Problem]:
    """The ladder's order broken by what was set: key, the numbers, and the fix."""
    out = []
    if not t["hang_deadline_s"] < t["collective_s"]:
        out.append(Problem("failover.progress_deadline_s, failover.timeout_s",
                           f"the hang deadline {t['hang_deadline_s']:g} s is not below the collective timeout "
                           f"{t['collective_s']:g} s: a collective would give up on a hung rank before it is named.",
                           f"set failover.timeout_s above {t['hang_deadline_s']:g} (e.g. "
                           f"{2 * t['hang_deadline_s']:g}), or leave it unset to derive it."))
    if not t["settle_s"] < t["quorum_s"]:
        out.append(Problem("failover.quorum_s", f"the quorum {t['quorum_s']:g} s is not above the settle window "
                           f"{t['settle_s']:g} s (failures gathered into one decision): copies hit at the same "
                           f"moment could be decided apart.",
                           f"set failover.quorum_s above {t['settle_s']:g} (e.g. {2 * t['settle_s']:g}), or leave "
                           f"it unset."))
    if "collective_bound_s" in t and not t["collective_bound_s"] < t["collective_s"]:
        out.append(Problem("failover.collective_bound_s, failover.timeout_s",
                           f"the cross-copy bound {t['collective_bound_s']:g} s is not below the collective timeout "
                           f"{t['collective_s']:g} s: a cut would time out before it is aborted.",
                           f"set failover.collective_bound_s below {t['collective_s']:g} (e.g. "
                           f"{t['collective_s'] / 4:g}), or leave it unset to derive it."))
    if not t["quorum_s"] < t["collective_s"]:
        out.append(Problem("failover.quorum_s, failover.timeout_s", f"the quorum {t['quorum_s']:g} s is not below "
                           f"the collective timeout {t['collective_s']:g} s: the coordinator would still wait for "
                           f"copies whose collectives have already given up.",
                           f"set failover.quorum_s below {t['collective_s']:g}, or failover.timeout_s above "
                           f"{t['quorum_s']:g}."))
    return out


def resolved(fo, t: dict):
    """failover.* with the derived quorum and collective timeout written in (what the runtime,
    the coordinator and the simulation read)."""
    import dataclasses

    return dataclasses.replace(fo, quorum_s=t["quorum_s"], timeout_s=t["collective_s"])


def lines(t: dict, node_fail_wait_s: float | None = None) -> list[str]:
    """The ladder as plan.md prints it."""
    derived = set(t.get("derived", ()))
    tag = {"progress_deadline_s": "hang_deadline_s", "quorum_s": "quorum_s", "timeout_s": "collective_s"}
    how = {v: " (derived)" if k in derived else " (set)" for k, v in tag.items()}
    out = [f"- settle window {t['settle_s']:.1f} s < quorum {t['quorum_s']:.1f} s{how['quorum_s']} < collective "
           f"timeout {t['collective_s']:.1f} s{how['collective_s']}; hang deadline {t['hang_deadline_s']:.1f} s"
           f"{how['hang_deadline_s']} < collective timeout"]
    if "stall_s" in t:
        out.append(f"- stall deadline {t['stall_s']:.1f} s: a rank that has not reached the cross-copy collective "
                   f"while its peers waited this long in it is named and its node lost")
    if "keepalive_s" in t:
        out.append(f"- control connections: TCP keepalive {t['keepalive_s']:.0f} s; a leader's connection that goes "
                   f"unanswered that long is its copy lost")
    if "collective_bound_s" in t:
        out.append(f"- cross-copy bound {t['collective_bound_s']:.1f} s: every rank in a step's cross-copy collective "
                   f"that long with no copy committing it is a cut the control plane cannot see; the generation is "
                   f"aborted and re-formed without the copy the others cannot reach")
    out.append("- a loss that is known (SLURM's node down, a leader's connection closed, a rank exited, a stall or "
               "hang named) aborts the survivors' pending cross-copy collectives at once and they go on in place; "
               "the collective timeout is the last resort, for a loss nobody noticed")
    slurm = (f"{node_fail_wait_s:g} s (launcher.node_fail_wait_s)" if node_fail_wait_s else
             "SlurmdTimeout + 30 s, read from scontrol when the job starts (launcher.node_fail_wait_s)")
    out.append(f"- SLURM: a node whose ranks died is confirmed lost within {slurm}; the nodes SLURM reports "
               f"within the settle window {t['settle_s']:.1f} s of the first are one recovery")
    return out

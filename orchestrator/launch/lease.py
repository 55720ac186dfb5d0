"""The supervisor's lease in the shared run directory: who supervises the run, and since when.

One supervisor is active; it renews the lease every `period_s` (timeouts.lease_period_s). A
standby supervisor on another node of the allocation (launch/standby.py) watches it; when it
has not been renewed for `timeout_s` (failover.lease_s: the active one's node is gone, frozen or
cut off from the file system) the standby claims the next generation and takes over.

Generations fence: generation N is claimed by creating RUN_DIR/lease/gen<N> exclusively
(O_CREAT | O_EXCL: of two standbys racing for it one wins), so the highest claim is the one
holder. A holder of generation N that finds gen<N+1> claimed steps down at its next renewal
(`renew` returns False): a supervisor that comes back (a node that was frozen, a partition that
healed) never acts beside its successor. lease/holder.json says who holds which generation and
when it last renewed (written whole, then renamed); times are wall-clock seconds (`clock`, which
the simulation replaces with its virtual one), compared across nodes, so the lease must be far
longer than their clock skew. Torch-free; every wait here is the caller's and bounded.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from orchestrator import rundir

GEN = re.compile(r"gen(\d+)")


def node() -> str:
    """The node this process runs on: SLURM's name for it (SLURMD_NODENAME), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def me() -> str:
    """This process as a lease holder: node:pid."""
    return f"{node()}:{os.getpid()}"


def for_run(spec, run_dir: Path) -> "Lease":
    """The run's lease, its timeout failover.lease_s (or derived: plan/timeouts.lease_s)."""
    from orchestrator.plan.timeouts import lease_s

    return Lease(run_dir, lease_s(spec.failover, spec.launcher.poll_s))


class Lease:
    def __init__(self, run_dir: Path, timeout_s: float, holder: str | None = None, host: str | None = None,
                 clock=time.time):
        self.dir = Path(run_dir) / rundir.LEASE
        self.timeout_s, self.clock = float(timeout_s), clock
        self.holder, self.host = holder or me(), host or node()
        self.generation = 0  # the one this process holds (0: none)

    # ---- reading ------------------------------------------------------------------------------
    def read(self) -> dict:
        """lease/holder.json ({} when nobody ever held the lease)."""
        try:
            held = json.loads((self.dir / rundir.LEASE_HOLDER).read_text())
        except (OSError, ValueError):
            return {}
        return held if isinstance(held, dict) else {}

    def claimed(self) -> int:
        """The highest generation claimed (0: none)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return 0
        return max((int(m.group(1)) for m in map(GEN.fullmatch, names) if m), default=0)

    def age_s(self, held: dict | None = None) -> float | None:
        """Seconds since the holder last renewed (None: never held)."""
        held = self.read() if held is None else held
        return None if "renewed" not in held else self.clock() - float(held["renewed"])

    def expired(self, held: dict | None = None) -> bool:
        """The holder has not renewed for its timeout (a lease never taken, or released, is not).
        A holder.json older than the highest claim (its claimant died before writing it) counts
        only past twice the timeout, so a claim being written is not taken for a dead one."""
        held = self.read() if held is None else held
        age = self.age_s(held)
        if age is None or held.get("released"):
            return False
        timeout = float(held.get("timeout_s", self.timeout_s))
        return age > (timeout if int(held.get("generation", 0)) >= self.claimed() else 2 * timeout)

    # ---- holding ------------------------------------------------------------------------------
    def acquire(self, after: int | None = None) -> bool:
        """Claim generation `after` + 1 (default: the highest claimed + 1): the first supervisor, or
        a standby that saw generation `after` expire. False when another claimed it first (of two
        standbys that saw the same generation expire, one wins)."""
        gen = (self.claimed() if after is None else int(after)) + 1
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.dir / f"gen{gen}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.holder} {self.clock()}\n")
        self.generation = gen
        self._write()
        return True

    def fenced(self) -> bool:
        """A later generation was claimed: this holder is no longer the supervisor."""
        return bool(self.generation) and (self.dir / f"gen{self.generation + 1}").exists()

    def renew(self) -> bool:
        """Renew the lease; False (and nothing written) when a successor fenced this holder."""
        if not self.generation or self.fenced():
            return False
        self._write()
        return not self.fenced()  # a claim made while writing: step down (the successor rewrites holder.json)

    def release(self) -> None:
        """The run ended under this holder: the lease says so, and a standby does not take over."""
        if self.generation and not self.fenced():
            self._write(released=True)

    def _write(self, **extra) -> None:
        rundir.write_json(self.dir / rundir.LEASE_HOLDER, {
            "generation": self.generation, "holder": self.holder, "host": self.host, "renewed": self.clock(),
            "timeout_s": self.timeout_s, **extra})


class Standby:
    """Keeps one standby supervisor running on a node of the allocation other than the supervisor's:
    `start(node)` starts it (srun.start_standby: a process whose poll() says when its step ended);
    `check()`, called every renewal, starts a new one when the last has ended while the run goes on
    (its node died, or it failed), on the next candidate that is neither lost (`gone()`: the nodes
    the supervisor knows lost) nor one a standby already ended on; the last nodes first. At most one
    start per candidate node: bounded."""

    def __init__(self, nodes: list[str], own: str, start, gone=lambda: (), going=lambda: True):
        self.candidates = [n for n in reversed(nodes) if n != own]
        self.start, self.gone, self.going = start, gone, going  # going(): the run goes on (a standby is needed)
        self.node, self.proc = None, None
        self.tried: list[str] = []  # nodes a standby was started on, in order

    def check(self) -> str | None:
        """Start a standby if none runs; the node it was started on, or None (one runs, or no node is left)."""
        if not self.going() or (self.node is not None and (self.proc is None or self.proc.poll() is None)):
            return None  # the run is over, or the last one still runs (or gave nothing to watch)
        gone = set(self.gone())
        for node in self.candidates:
            if node not in gone and node not in self.tried:
                self.node, self.proc = node, self.start(node)
                self.tried.append(node)
                return node
        self.node = self.proc = None  # no node left for one: looked at again each period, starting none
        return None


class Renewer:
    """Renews a lease every `period_s` on a thread of its own (the supervisor's loop may block in a
    sinfo call or a re-plan); when the lease is lost (fenced) it calls `on_fenced` once and stops."""

    def __init__(self, lease: Lease, period_s: float, on_fenced, on_renewed=None):
        import threading

        self.lease, self.period_s, self.on_fenced = lease, float(period_s), on_fenced
        self.on_renewed = on_renewed  # called after each renewal (the standby looked after: Standby.check)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                ok = self.lease.renew()
            except OSError:  # the file system did not answer this time: the next period tries again
                continue
            if not ok:
                self.on_fenced()
                return
            if self.on_renewed is not None:
                try:
                    self.on_renewed()
                except (OSError, subprocess.SubprocessError) as e:  # a standby that cannot start now: next period
                    print(f"standby supervisor not started: {e}", flush=True)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.period_s + 5.0)

"""The job's coordinator: decides membership and grants every step's commit when the model
state has several copies (layout.dp_shard < dp), as torchft's lighthouse does. Torch-free.

Only copy leaders talk to it, over authenticated JSON lines (train/wire.py; the server is
control_server.py). A state machine with no blocking wait: a request is answered now or
later through its `reply`, and `tick()` fires the deadlines, so the same object runs under
the TCP server and under the simulator's virtual clock (benchmarks/failover_sim.py).

- commit: each leader sends its copy's sums (loss, count, stop); once every copy of the
  generation did, every leader gets the same answer with the totals (the loss and stop
  flag cross copies here, not over a group of all ranks). O(1) a message, O(R) a step.
- failed: a copy whose cross-copy collective failed. The coordinator waits up to
  `quorum_s` for the other copies to reach the boundary, calls the supervisor's
  `decide(alive, dead, joiners, step)` and answers "reform" (new generation) or "exit".
- join: a launched warm spare or a node back waits to be admitted; `now` asks for a change.
- bye: a leader that finished; otherwise a leader's connection closing is its copy lost.
- stragglers: each commit carries the copy's own work in the step (`busy`, seconds) and
  whether a checkpoint save shared it; each committed step feeds them to `stragglers`
  (launch/stragglers.py), and the launcher takes who was named.
- Deadlines: a step whose first commit came `commit_timeout_s` ago without the others
  becomes a membership change (the missing copies are dropped after the quorum window).

Anything else (unsigned, forged, replayed, malformed, an unknown op, a copy not in the
generation or never launched, a stale or future generation, a wrong step, a duplicate) is
dropped and counted in `dropped` (reason -> count) and changes nothing.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch.control_server import ControlServer
from orchestrator.train import wire
from orchestrator.train.wire import finite


@dataclass
class Generation:
    gen: int
    copies: list[int]  # copy ids taking part, in their data order
    plan_dir: str
    step: int = 0  # the step this generation starts at


@dataclass
class Decision:
    """The supervisor's answer to a change of membership."""

    reform: bool
    plan_dir: str = ""
    copies: list[int] = field(default_factory=list)  # the new generation's copies, in data order
    reason: str = ""
    new: list[int] = field(default_factory=list)  # copies that need a healthy copy's state


OPS = ("commit", "failed", "join", "bye")


class Coordinator:
    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float = 5.0,
                 commit_timeout_s: float = 60.0, clock=time.monotonic, stragglers=None):
        self.stragglers = stragglers  # launch/stragglers.Stragglers, or None: not watched
        self.busy: dict[int, tuple[float, bool]] = {}  # copy -> (its work, saving) for self.step
        self.current = Generation(0, list(copies), plan_dir)
        self.members = set(copies)
        self.launched = set(copies)  # copies the launcher started (expect()): only they may join
        self.decide, self.quorum_s, self.commit_timeout_s, self.clock = decide, quorum_s, commit_timeout_s, clock
        self.lock = threading.RLock()
        self.step: int | None = None  # the step being committed (set by its first commit in generation 0)
        self.sums: dict[int, list] = {}  # copy -> its (loss, count, stop) for self.step
        self.first_at: float | None = None  # when self.step's first commit arrived
        self.waiting: dict[int, object] = {}  # copy -> reply of its pending commit or report
        self.reporting: dict[int, int] = {}  # copy -> step it reported failed (or waits at) in a change
        self.joiners: dict[int, object] = {}  # copy -> reply of its pending join
        self.now: set[int] = set()  # joiners that asked for a change (once)
        self.dead: set[int] = set()
        self.finished: set[int] = set()
        self.changing: float | None = None  # when the current membership change began
        self.first_report = 0.0  # when the first copy reached the boundary in this change
        self.answer: dict | None = None  # the last reform/exit, for copies that ask late
        self.dropped: Counter = Counter()
        self._dropped = 0
        self.commits = 0
        self.commit_s: deque = deque(maxlen=4096)  # first arrival -> grant, per step (bounded)
        self.last_commit = time.time()
        self.history: list[dict] = []

    # ---- the supervisor's side ----------------------------------------------------------
    def expect(self, copy: int) -> None:
        """The launcher started this copy (a warm spare, a node back): it may join."""
        with self.lock:
            self.launched.add(copy)

    def lost(self, copies: list[int]) -> None:
        """The supervisor saw these copies die (a process or node gone)."""
        with self.lock:
            gone = set(copies) & self.members
            if gone:
                self.dead |= gone
                self._begin_change()
                self._maybe_conclude()

    def admit(self, copy: int) -> None:
        """A launched copy may come in at the next boundary (it still sends its join)."""
        with self.lock:
            self.launched.add(copy)
            self.now.add(copy)
            self._begin_change()

    def closed(self, copy: int) -> None:
        """A leader's connection closed: a member that did not say bye is lost; a joiner leaves."""
        with self.lock:
            self.joiners.pop(copy, None)
            self.now.discard(copy)
            if copy in self.members and copy not in self.finished:
                self.waiting.pop(copy, None)
                self.lost([copy])

    def tick(self) -> None:
        """Fire the deadlines (the server calls this every few tenths of a second)."""
        with self.lock:
            if (self.changing is None and self.first_at is not None
                    and self.clock() - self.first_at > self.commit_timeout_s):
                self._begin_change()
            self._maybe_conclude()

    def drop(self, reason: str) -> None:
        with self.lock:
            self.dropped[reason] += 1
            self._dropped += 1

    def dropped_total(self) -> int:
        return self._dropped

    # ---- the leaders' side ----------------------------------------------------------------
    def handle(self, msg: dict, reply) -> None:
        """One authenticated message; `reply(dict)` answers it (now or later), or never when dropped."""
        with self.lock:
            why = self._invalid(msg)
            if why:
                self.drop(why)
                return
            op, copy = msg["op"], msg["copy"]
            if op == "join":
                return self._join(copy, bool(msg.get("now")), reply)
            if op == "bye":
                self.finished.add(copy)
                return
            gen = msg["gen"]
            if gen < self.current.gen:  # an answer it missed while it computed
                return reply(self._answer_for(copy))
            if op == "commit" and self.changing is None:
                return self._commit(copy, msg["step"], msg["sums"], reply, msg.get("busy"), bool(msg.get("saving")))
            self.waiting[copy] = reply
            self._report(copy, msg["step"])
            self.sums.pop(copy, None)
            self._begin_change()
            self._maybe_conclude()

    def _invalid(self, msg: dict) -> str | None:
        """Why this message is out of protocol (None: it is not)."""
        op, copy = msg.get("op"), msg.get("copy")
        if op not in OPS:
            return "unknown_op"
        if not isinstance(copy, int) or isinstance(copy, bool):
            return "malformed"
        if op == "join":
            if copy not in self.launched:
                return "join_not_launched"
            return "join_member" if copy in self.members or copy in self.joiners else None
        gen, step = msg.get("gen"), msg.get("step")
        if not isinstance(gen, int) or (op != "bye" and not isinstance(step, int)):
            return "malformed"
        if gen > self.current.gen:
            return "future_generation"
        if gen < self.current.gen:
            return None if op != "bye" and self.answer is not None else "stale_generation"
        if copy not in self.members:
            return "not_in_generation"
        if copy in self.waiting:
            return "duplicate"
        if op == "commit":
            sums = msg.get("sums")
            if not (isinstance(sums, list) and len(sums) == 3 and all(finite(x) for x in sums)):
                return "malformed"
            if not finite(msg.get("busy", 0.0)) or msg.get("busy", 0.0) < 0:
                return "malformed"
            if self.changing is None and self.step is not None and step != self.step:
                return "wrong_step"
        return None

    def _commit(self, copy: int, step: int, sums: list, reply, busy=None, saving: bool = False) -> None:
        if self.step is None:
            self.step = step
        if not self.sums:
            self.first_at = self.clock()
            self.busy = {}
        self.sums[copy] = sums
        if busy is not None:
            self.busy[copy] = (float(busy), saving)
        self.waiting[copy] = reply
        if len(self.sums) < len(self.members):
            return
        loss, count, stop = (sum(self.sums[c][i] for c in self.current.copies) for i in range(3))
        answer = {"op": "commit", "step": step, "loss": loss / count if count else None, "stop": stop > 0}
        self.commit_s.append(self.clock() - self.first_at)
        replies = [self.waiting[c] for c in self.current.copies]
        self.sums, self.waiting, self.first_at, self.step = {}, {}, None, step + 1
        self.commits += 1
        self.last_commit = time.time()
        if self.stragglers is not None:
            self.stragglers.observe(step, self.busy)
        self.busy = {}
        for r in replies:  # each leader woken once, when the step is complete
            r(answer)

    def _join(self, copy: int, now: bool, reply) -> None:
        self.joiners[copy] = reply
        if now:
            self.now.add(copy)
        if copy in self.now:
            self._begin_change()

    def _begin_change(self) -> None:
        if self.changing is not None:
            return
        self.changing = self.clock()
        for c in self.sums:  # who already asked to commit this step waits at its boundary
            self._report(c, self.step)
        self.sums, self.first_at = {}, None

    def _report(self, copy: int, step: int) -> None:
        if not self.reporting:
            self.first_report = self.clock()
        self.reporting[copy] = step

    def _maybe_conclude(self) -> None:
        """Every copy still alive reached the boundary, or `quorum_s` passed since the first did (not
        since the change began: survivors blocked in a collective until its timeout all report
        late, together, and must not be cut off by a window that ran out while they were blocked)."""
        if self.changing is None or not self.reporting:
            return
        if self.clock() - self.first_report > self.quorum_s:
            return self._conclude()
        if len(self.reporting) < len(self.members) - len(self.dead):  # O(1): not all yet (the exact test is O(R))
            return
        if all(c in self.reporting for c in self.members if c not in self.dead):
            self._conclude()

    def _conclude(self) -> None:
        alive = [c for c in self.current.copies if c in self.reporting and c not in self.dead]
        dead = [c for c in self.current.copies if c not in alive]
        steps = [self.reporting[c] for c in alive]
        step = min(steps) if steps else 0
        decision = self.decide(alive, dead, sorted(self.joiners), step)
        if decision.reform:
            self.current = Generation(self.current.gen + 1, list(decision.copies), decision.plan_dir, step)
            self.answer = {"op": "reform", "gen": self.current.gen, "copies": list(decision.copies),
                           "plan_dir": decision.plan_dir, "step": step, "new": list(decision.new)}
        else:
            self.answer = {"op": "exit", "reason": decision.reason, "gen": self.current.gen + 1}
            self.current = Generation(self.current.gen + 1, [], "", step)
        self.history.append({"time": time.time(), "alive": alive, "dead": dead, **self.answer})
        self.members = set(self.current.copies)
        replies = list(self.waiting.items())
        replies += [(c, r) for c, r in self.joiners.items() if c in self.members or not decision.reform]
        self.joiners = {c: r for c, r in self.joiners.items() if c not in self.members and decision.reform}
        self.now = set()  # a joiner left out waits as a spare: it does not ask again
        self.reporting, self.waiting, self.sums, self.dead, self.changing = {}, {}, {}, set(), None
        self.first_at, self.step = None, step
        for c, r in replies:
            r(self._answer_for(c))

    def _answer_for(self, copy: int) -> dict:
        if self.answer is None:
            return {"op": "exit", "reason": "no membership decided"}
        if self.answer["op"] == "reform" and copy not in self.members:  # (a set: O(1) a copy, O(R) a reform)
            return {"op": "exit", "reason": f"copy {copy} is not part of generation {self.answer['gen']}"}
        return self.answer

    def take_stragglers(self) -> list:
        """The copies named stragglers since the last call (launch/stragglers.Straggler)."""
        with self.lock:
            return self.stragglers.take() if self.stragglers is not None else []

    def counts(self) -> dict:
        """What the job's log and status show: commits, and what was dropped, by reason."""
        with self.lock:
            return {"generation": self.current.gen, "commits": self.commits, "dropped": dict(self.dropped),
                    "dropped_total": self._dropped}


def bind_address(host: str) -> str:
    """Where to listen: 127.0.0.1 for a local run; on SLURM the address of the first node's
    host name (the allocation's own interface), never every interface."""
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostbyname(host)


class JobServices:
    """What a run with several copies of the state needs beside its ranks: the job's
    rendezvous store (a process of its own, orchestrator.train.rendezvous, so it outlives any
    rank), the coordinator on a TCP port, and the job's secret (RUN_DIR/control.key, 0600).
    `env` is what every rank needs to find them (the secret by its file, not its value)."""

    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float, host: str,
                 run_dir: str | None = None, commit_timeout_s: float = 60.0, say=None, stragglers=None):
        self.run_dir, self.say = Path(run_dir or plan_dir), say or (lambda text: print(text, flush=True))
        bind = bind_address(host)
        key_file = wire.make_secret(self.run_dir)
        self.rendezvous = subprocess.Popen([sys.executable, "-m", "orchestrator.train.rendezvous", "0", bind],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port = int(self.rendezvous.stdout.readline())
        self.coordinator = Coordinator(copies, plan_dir, decide, quorum_s=quorum_s, commit_timeout_s=commit_timeout_s,
                                       stragglers=stragglers)
        self.reported = 0
        self.server = ControlServer(self.coordinator, wire.read_secret(key_file), host=bind, on_tick=self._report)
        job = os.environ.get("SLURM_JOB_ID") or secrets.token_hex(4)
        self.env = {rundir.ENV_STORE: f"{bind}:{port}", rundir.ENV_CONTROL: self.server.address(bind),
                    wire.KEY_ENV: str(key_file), rundir.ENV_JOB: f"job{job}.{secrets.token_hex(2)}"}
        from orchestrator.launch.status import write_status

        write_status(self.run_dir, control_address=self.env[rundir.ENV_CONTROL])  # not a secret: the key is

    def _report(self) -> None:
        """Dropped control messages into the job's log and status.json (when their count changes)."""
        counts = self.coordinator.counts()
        if counts["dropped_total"] == self.reported:
            return
        self.reported = counts["dropped_total"]
        from orchestrator.launch.status import write_status

        write_status(self.run_dir, control=counts)
        self.say(f"control: {counts['dropped_total']} message(s) dropped so far {counts['dropped']}")

    def close(self) -> None:
        self.server.close()
        self._report()
        self.rendezvous.kill()
        self.rendezvous.wait()

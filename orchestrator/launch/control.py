"""The job's coordinator: decides membership and grants every step's commit when the model
state has several copies (layout.dp_shard < dp), as torchft's lighthouse does. Torch-free.

Only copy leaders talk to it, over authenticated JSON lines (train/wire.py; the server is
train/control_server.py). A state machine with no blocking wait: a request is answered now or
later through its `reply`, and `tick()` fires the deadlines, so the same object runs under
the TCP server and under the simulator's virtual clock (benchmarks/failover_sim.py).

- commit: each leader sends its copy's sums (loss, count, stop); once every copy of the
  generation did, every leader gets the same answer with the totals (the loss and stop
  flag cross copies here, not over a group of all ranks). With more copies than the fan-in
  `fan_in` the commits come summed up a tree of leaders (train/tree.py): a message names the
  size `n` of the subtree it sums, so the coordinator reads k messages a step, not R. A
  commit for the step just granted gets that grant again (its aggregator died before passing
  it on). O(1) a message, O(R) a step at most.
- hi: a leader binds its connection to its copy and says where its aggregator listens;
  tree: a leader asks for its parent's address in the generation's tree.
- When a change of membership begins, every copy not yet heard from is pushed a `report`
  (its commit then comes here directly: a dead or hung aggregator strands nobody).
- failed: a copy whose cross-copy collective failed. The coordinator waits up to
  `quorum_s` for the other copies to reach the boundary, calls the supervisor's
  `decide(alive, dead, joiners, step)` and answers "reform" (new generation) or "exit".
- join: a launched warm spare or a node back waits to be admitted; `now` asks for a change.
- bye: a leader that finished; otherwise a leader's connection closing is its copy lost.
- abort on knowledge: when a copy is known lost (the supervisor's `lost`: a rank exited, SLURM
  named its node down, its ranks stalled or hung past their deadline; or its leader's
  connection closed) the survivors' pending cross-copy collectives are aborted at once:
  `abort(gen, dead)` (the job's store wakes every rank's watcher, train/replicas.py), so they
  report at the boundary without waiting for the collective timeout, which stays the last
  resort for a loss nobody noticed. When a change concludes, `abort(old_gen, [])` releases the
  old generation's watchers (nobody is left in its collectives but the copies cut off).
- a partition the control plane cannot see (a copy cut off from the others on the data path
  while its leader's connection is up): every copy waits in the step's cross-copy collective,
  and all beat `wait`, so no deadline names anyone. The watcher (launch/progress.in_collective,
  from the beats) tells `in_collective(step, waited_s)` once every rank is in step s's collective,
  the last of them `waited_s` ago; no commit of step s has arrived (the collective did not
  complete anywhere) and the wait is past `collective_s` (the plan's predicted cross-copy
  all-reduce with a margin: plan/timeouts.collective_bound_s): the generation is aborted
  (`abort(gen, [])`, the existing path) and every copy reports at the boundary. A report may
  say which copies its data path reached and could not reach (`reached`, `unreached`: each
  leader tries its ring neighbours, tree.reach_peers); a copy that more of those that tried it
  could not reach than could is declared lost (`cut`), the rest re-form without it. A
  straggler is not this (the clock starts when the last copy enters), nor a slow collective that
  completes within the bound. At most MAX_CUT_ABORTS such aborts in a row without a step
  committed: then the collective timeout is the last resort again.
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
from orchestrator.train.control_server import ControlServer
from orchestrator.train import tree, wire
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
    # the survivors keep the gradients they computed for the step in flight, and the new generation
    # recomputes only the lost copies' micro-batches (train/trainer.py); False: it redoes the step
    keep: bool = False


OPS = ("commit", "failed", "join", "bye", "hi", "tree")
MAX_CUT_ABORTS = 2  # partition aborts in a row with no step committed between them (then: the collective timeout)


class Coordinator:
    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float = 5.0,
                 commit_timeout_s: float = 60.0, clock=time.monotonic, fan_in: int = 0, push=None, stragglers=None,
                 abort=None, collective_s: float | None = None):
        self.collective_s = collective_s  # the bound on a cross-copy collective every copy is in (None: no bound)
        self.cut_aborts = 0  # partition aborts since the last committed step
        self.unreached: dict[int, set] = {}  # copy -> the copies its data path could not reach (its failed report)
        self.reached: dict[int, set] = {}  # copy -> the copies it tried and reached
        self.abort = abort  # abort(gen, dead copies): wake the survivors out of gen's cross-copy collectives
        self.aborted: dict | None = None  # {gen, dead, at}: the abort of the current change, for its history
        self.stragglers = stragglers  # launch/stragglers.Stragglers, or None: not watched
        self.busy: dict | None = None  # the copies' busy summary for self.step (train/tree.busy_of)
        self.current = Generation(0, list(copies), plan_dir)
        self.members = set(copies)
        self.fan_in = fan_in or tree.fan_in(len(copies))  # k: the commit tree's fan-in (>= R: flat)
        self.push = push  # push(copy, message): to a leader's own connection (the server sets it)
        self.pos = {c: i for i, c in enumerate(copies)}  # copy -> position in the generation's tree
        self.addr: dict[int, str] = {}  # copy -> where its aggregator listens (hi)
        self.counted = 0  # copies whose commit of self.step is in (a subtree counts its size)
        self.off_tree: list[int] = []  # positions that committed here although their parent is a leader
        self.granted: tuple = (None, None, None)  # (gen, step, answer) of the last grant
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
                if self.abort is not None:  # known lost: nobody waits for the collective timeout on it
                    self.aborted = {"gen": self.current.gen, "dead": sorted(self.dead), "at": self.clock(),
                                    "why": "lost"}
                    self.abort(self.current.gen, sorted(self.dead))
                self._maybe_conclude()

    def in_collective(self, step: int, waited_s: float) -> bool:
        """The watcher saw every rank of the job in step `step`'s cross-copy collective (or its commit),
        the last of them for `waited_s` seconds. True when that is past the bound with no commit of
        the step in: a partition nobody sees; the generation's collectives are aborted now."""
        with self.lock:
            if (self.collective_s is None or self.abort is None or self.changing is not None or not self.members
                    or waited_s <= self.collective_s or self.cut_aborts >= MAX_CUT_ABORTS):
                return False
            if self.first_at is not None or self.counted or self.granted[1] == step or (
                    self.step is not None and step < self.step):
                return False  # a commit of the step came in: the collective completed (its commit round is slow)
            self.cut_aborts += 1
            self.aborted = {"gen": self.current.gen, "dead": [], "at": self.clock(), "why": "partition",
                            "step": step, "waited_s": waited_s, "bound_s": self.collective_s}
            self._begin_change()
            self.abort(self.current.gen, [])
            self._maybe_conclude()
            return True

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
            if op == "hi":
                if isinstance(msg.get("addr"), str):
                    self.addr[copy] = msg["addr"][:256]
                return
            gen = msg["gen"]
            if gen < self.current.gen:  # an answer it missed while it computed
                return reply(self._answer_for(copy))
            if op == "tree":
                up = tree.parent(self.pos[copy], self.fan_in)
                return reply({"op": "tree", "gen": gen, "k": self.fan_in,
                              "parent": "" if up == tree.ROOT else self.addr.get(self.current.copies[up], "")})
            if op == "commit" and self.granted[:2] == (gen, msg["step"]):
                return reply(self.granted[2])  # granted already: its aggregator did not pass it on
            n = msg.get("n", 1)
            if op == "commit" and self.changing is None:
                return self._commit(copy, msg["step"], msg["sums"], reply, n, tree.busy_of(msg))
            self.waiting[copy] = reply
            for name, into in (("unreached", self.unreached), ("reached", self.reached)):
                if op == "failed" and isinstance(msg.get(name), list):  # what its data path reached after the abort
                    into[copy] = {c for c in msg[name][:len(self.pos)] if type(c) is int and c in self.pos and c != copy}
            if n > 1:  # a subtree's sum reaching the boundary: each of its copies reports
                for p in tree.subtree(self.pos[copy], len(self.current.copies), self.fan_in):
                    self._report(self.current.copies[p], msg["step"])
            else:
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
        if op == "hi":
            return None if copy in self.members or copy in self.launched else "not_in_generation"
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
            sums, n = msg.get("sums"), msg.get("n", 1)
            if not (isinstance(sums, list) and len(sums) == 3 and all(finite(x) for x in sums)):
                return "malformed"
            if not tree.valid_busy(msg):
                return "malformed"
            if n != 1 and n != tree.subtree_size(self.pos[copy], len(self.current.copies), self.fan_in):
                return "malformed"  # a sum must cover exactly its subtree
            if self.granted[:2] == (gen, step):
                return None
            if self.changing is None and self.step is not None and step != self.step:
                return "wrong_step"
        return None

    def _commit(self, copy: int, step: int, sums: list, reply, n: int = 1, busy: dict | None = None) -> None:
        if self.step is None:
            self.step = step
        if not self.sums:
            self.first_at = self.clock()
            self.busy = None
        if self._overlaps(copy, n):  # a copy counted twice (it re-homed while its sum was on the way)
            self.waiting[copy] = reply
            self._report(copy, step)
            return self._begin_change()  # the safe way out: every copy reports, the step is redone
        self.sums[copy] = (sums, n)
        self.busy = tree.merge_busy(self.busy, busy)
        self.waiting[copy] = reply
        self.counted += n
        if self.counted < len(self.members):
            return
        loss, count, stop = (sum(s[i] for s, _ in self.sums.values()) for i in range(3))
        answer = {"op": "commit", "step": step, "loss": loss / count if count else None, "stop": stop > 0}
        self.commit_s.append(self.clock() - self.first_at)
        replies = list(self.waiting.values())
        self.sums, self.waiting, self.first_at, self.step, self.counted = {}, {}, None, step + 1, 0
        self.off_tree = []
        self.granted = (self.current.gen, step, answer)
        self.commits += 1
        self.cut_aborts = 0
        self.last_commit = time.time()
        if self.stragglers is not None and self.busy is not None:
            self.stragglers.observe(step, self.busy)
        self.busy = None
        for r in replies:  # each leader (or aggregator) woken once, when the step is complete
            r(answer)

    def _overlaps(self, copy: int, n: int) -> bool:
        """Whether this commit covers a copy already counted this step: O(depth) for a commit from
        the tree's top, O(depth x off-tree commits) otherwise (a copy that re-homed here)."""
        pos, k = self.pos[copy], self.fan_in
        if tree.parent(pos, k) != tree.ROOT:  # off the tree: one of its ancestors may hold it
            if any(self.current.copies[a] in self.sums for a in tree.ancestors(pos, k)):
                return True
            self.off_tree.append(pos)
        if n > 1:  # a sum: does it hold a copy that came here on its own?
            return any(pos in tree.ancestors(p, k) for p in self.off_tree if p != pos)
        return False

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
        R, k = len(self.current.copies), self.fan_in
        for c, (_, n) in self.sums.items():  # who already asked to commit this step waits at its boundary
            for p in (tree.subtree(self.pos[c], R, k) if n > 1 else (self.pos[c],)):
                self._report(self.current.copies[p], self.step)
        self.sums, self.first_at, self.counted, self.off_tree = {}, None, 0, []
        if self.push is not None and k < R:  # copies held up in the tree: send your commit here
            push = {"op": "report", "gen": self.current.gen}
            for c in self.current.copies:
                if c not in self.reporting and c not in self.dead:
                    self.push(c, push)

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

    def cut_off(self) -> list[int]:
        """After a partition abort: the copies that more of the reporters who tried them could not
        reach than could (`unreached` / `reached` in their failed reports: each leader tries its
        ring neighbours, tree.reach_peers); none when that would be every reporter (two copies cut
        from each other: who is cut is not knowable)."""
        reporters = [c for c in self.reporting if c not in self.dead]
        against = Counter(c for r in reporters for c in self.unreached.get(r, ()))
        for_ = Counter(c for r in reporters for c in self.reached.get(r, ()))
        cut = sorted(c for c, v in against.items() if c in self.reporting and v > for_[c])
        return cut if len(cut) < len(reporters) else []

    def _conclude(self) -> None:
        cut = self.cut_off() if self.unreached else []  # (after a partition abort, or a collective timed out)
        self.dead |= set(cut)
        if self.aborted is not None and self.aborted.get("why") == "partition":
            self.aborted["cut"] = cut
        alive = [c for c in self.current.copies if c in self.reporting and c not in self.dead]
        dead = [c for c in self.current.copies if c not in alive]
        steps = [self.reporting[c] for c in alive]
        step = min(steps) if steps else 0
        old, aborted = self.current.gen, self.aborted  # (the decision's event reads self.aborted)
        decision = self.decide(alive, dead, sorted(self.joiners), step)
        self.aborted = None
        if decision.reform:
            before = self.current
            self.current = Generation(self.current.gen + 1, list(decision.copies), decision.plan_dir, step)
            self.answer = {"op": "reform", "gen": self.current.gen, "copies": list(decision.copies),
                           "plan_dir": decision.plan_dir, "step": step, "new": list(decision.new)}
            if decision.keep:  # the old generation's split of the step (its plan) and where in it the lost were
                gone = set(before.copies) - set(decision.copies)  # (positions, not the copies: the answer stays small)
                self.answer["kept"] = {"lost": [i for i, c in enumerate(before.copies) if c in gone],
                                       "plan_dir": before.plan_dir}
        else:
            self.answer = {"op": "exit", "reason": decision.reason, "gen": self.current.gen + 1}
            self.current = Generation(self.current.gen + 1, [], "", step)
        self.history.append({"time": time.time(), "alive": alive, "dead": dead, **self.answer,
                             "aborted": aborted})  # the survivors were woken at once (None: they found out)
        self.members = set(self.current.copies)
        self.pos = {c: i for i, c in enumerate(self.current.copies)}
        self.granted = (None, None, None)
        replies = list(self.waiting.items())
        replies += [(c, r) for c, r in self.joiners.items() if c in self.members or not decision.reform]
        self.joiners = {c: r for c, r in self.joiners.items() if c not in self.members and decision.reform}
        self.now = set()  # a joiner left out waits as a spare: it does not ask again
        self.reporting, self.waiting, self.sums, self.dead, self.changing = {}, {}, {}, set(), None
        self.unreached, self.reached = {}, {}
        self.first_at, self.step, self.counted, self.off_tree = None, step, 0, []
        for c, r in replies:
            r(self._answer_for(c))
        if self.abort is not None:  # the old generation is over: release its watchers
            self.abort(old, [])

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
    rank; `shards` TCPStore servers, rundir.store_shards), the coordinator on a TCP port, and the
    job's secret (RUN_DIR/control.key, 0600). `env` is what every rank needs to find them (the
    secret by its file, not its value)."""

    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float, host: str,
                 run_dir: str | None = None, commit_timeout_s: float = 60.0, say=None, stragglers=None,
                 shards: int = 1, collective_s: float | None = None):
        self.run_dir, self.say = Path(run_dir or plan_dir), say or (lambda text: print(text, flush=True))
        bind = bind_address(host)
        key_file = wire.make_secret(self.run_dir)
        self.rendezvous = subprocess.Popen([sys.executable, "-m", "orchestrator.train.rendezvous", "0", bind,
                                            str(shards)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ports = [int(p) for p in self.rendezvous.stdout.readline().split()]
        self.job = f"job{os.environ.get('SLURM_JOB_ID') or secrets.token_hex(4)}.{secrets.token_hex(2)}"
        self.coordinator = Coordinator(copies, plan_dir, decide, quorum_s=quorum_s, commit_timeout_s=commit_timeout_s,
                                       stragglers=stragglers, abort=self._abort, collective_s=collective_s)
        self.reported = 0
        self.server = ControlServer(self.coordinator, wire.read_secret(key_file), host=bind, on_tick=self._report)
        self.env = {rundir.ENV_STORE: ",".join(f"{bind}:{port}" for port in ports), rundir.ENV_CONTROL: self.server.address(bind),
                    wire.KEY_ENV: str(key_file), rundir.ENV_JOB: self.job}
        from orchestrator.launch.status import write_status

        write_status(self.run_dir, control_address=self.env[rundir.ENV_CONTROL])  # not a secret: the key is

    def _abort(self, gen: int, dead: list[int]) -> None:
        """Wake every rank of generation `gen` out of its cross-copy collectives: the store sets the
        generation's abort key on every shard (rundir.abort_key; train/rendezvous.py sets it,
        train/replicas.py watches it on its copy's shard), naming the copies lost."""
        import json

        try:
            value = json.dumps(dead, separators=(",", ":"))
            self.rendezvous.stdin.write(f"set {self.job}/{rundir.abort_key(gen)} {value}\n")
            self.rendezvous.stdin.flush()
        except (OSError, ValueError):  # the store is gone: the collectives time out as before
            pass

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

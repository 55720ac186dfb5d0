"""The job's coordinator: a small TCP server (JSON lines, torch-free) that the supervisor
runs beside the ranks when the model state has several copies (layout.dp_shard < dp).

Each copy of the state trains in its own torch world; what crosses copies (gradient
averaging, the loss) goes through groups the copies build per generation. The
coordinator keeps them in step and decides membership, as torchft's lighthouse does:

- commit: at the end of every step each copy's leader asks to commit step t; the answer
  comes once every copy of the generation asked (then all step their optimizers, so no
  copy is ever a step ahead), or is "reform" when the membership is changing;
- failed: a copy whose cross-copy collective failed reports it; the coordinator waits
  up to `quorum_s` for the other copies to reach the same point, calls the supervisor's
  `decide(alive, dead, step)` (which plans the next layout or refuses), and answers every
  waiting copy: "reform" with the new generation (plan, copy indices) or "exit";
- join: a warm spare or a rejoining node's copy waits to be admitted at the next reform.
"""
from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field


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


class Coordinator:
    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float = 5.0):
        self.current = Generation(0, list(copies), plan_dir)
        self.decide, self.quorum_s = decide, quorum_s
        self.cv = threading.Condition()
        self.commits: dict[int, set[int]] = {}  # step -> copies that asked
        self.reporting: dict[int, int] = {}  # copy -> step it reported failed (or waits at) in a reform
        self.joiners: set[int] = set()
        self.dead: set[int] = set()
        self.changing: float | None = None  # when the current membership change began
        self.answer: dict | None = None  # the last reform/exit, for copies that ask late
        self.last_commit = time.time()
        self.history: list[dict] = []

    # ---- the supervisor's side ----------------------------------------------------------
    def lost(self, copies: list[int]) -> None:
        """The supervisor saw these copies die (a process or node gone)."""
        with self.cv:
            self.dead |= set(copies) & set(self.current.copies)
            if self.changing is None:
                self.changing = time.monotonic()
            self.cv.notify_all()

    def admit(self, copy: int) -> None:
        """A new copy (a spare, a node back) wants in: change membership at the next boundary."""
        with self.cv:
            self.joiners.add(copy)
            if self.changing is None:
                self.changing = time.monotonic()
            self.cv.notify_all()

    # ---- the copies' side -----------------------------------------------------------------
    def handle(self, msg: dict) -> dict:
        op, copy, gen = msg["op"], int(msg["copy"]), int(msg.get("gen", -1))
        with self.cv:
            if op == "join":  # waits (warm) until a decision admits it
                self.joiners.add(copy)
                while copy not in self.current.copies:
                    entry = self.current.gen
                    if msg.get("now") and self.changing is None:
                        self.changing = time.monotonic()
                    self._wait_for_answer(copy, entry)
                return self._answer_for(copy)
            if gen < self.current.gen:  # an answer it missed while it computed
                return self._answer_for(copy)
            step = int(msg["step"])
            if op == "commit" and self.changing is None:
                self.commits.setdefault(step, set()).add(copy)
                self.cv.notify_all()
                while self.changing is None and self.commits[step] < set(self.current.copies):
                    self.cv.wait(timeout=0.5)
                if self.changing is None:
                    self.last_commit = time.time()
                    return {"op": "commit", "step": step}
            self.reporting[copy] = step
            if self.changing is None:
                self.changing = time.monotonic()
            self.cv.notify_all()
            return self._wait_for_answer(copy, gen)

    def _wait_for_answer(self, copy: int, gen: int) -> dict:
        """Block until a decision ends generation `gen` (taking it when this copy is the one
        that finds the membership settled)."""
        while self.current.gen == gen:
            if self._ready():
                self._conclude()
                break
            self.cv.wait(timeout=0.2)
        return self._answer_for(copy)

    def _ready(self) -> bool:
        """Every copy that is still alive has reached the boundary, or the quorum window passed."""
        if self.changing is None or not self.reporting:
            return False
        alive = set(self.current.copies) - self.dead
        waited = time.monotonic() - self.changing
        return alive <= set(self.reporting) or waited > self.quorum_s

    def _conclude(self) -> None:
        alive = [c for c in self.current.copies if c in self.reporting and c not in self.dead]
        dead = [c for c in self.current.copies if c not in alive]
        steps = [self.reporting[c] for c in alive]
        step = min(steps) if steps else 0
        decision = self.decide(alive, dead, sorted(self.joiners), step)
        if decision.reform:
            self.current = Generation(self.current.gen + 1, decision.copies, decision.plan_dir, step)
            self.answer = {"op": "reform", "gen": self.current.gen, "copies": decision.copies,
                           "plan_dir": decision.plan_dir, "step": step, "new": decision.new}
            self.joiners -= set(decision.copies)
        else:
            self.answer = {"op": "exit", "reason": decision.reason, "gen": self.current.gen + 1}
            self.current = Generation(self.current.gen + 1, [], "", step)
        self.history.append({"time": time.time(), "alive": alive, "dead": dead, **self.answer})
        self.reporting, self.commits, self.dead, self.changing = {}, {}, set(), None
        self.cv.notify_all()

    def _answer_for(self, copy: int) -> dict:
        if self.answer is None:
            return {"op": "exit", "reason": "no membership decided"}
        if self.answer["op"] == "reform" and copy not in self.answer["copies"]:
            return {"op": "exit", "reason": f"copy {copy} is not part of generation {self.answer['gen']}"}
        return self.answer


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            reply = self.server.coordinator.handle(json.loads(line))
            self.wfile.write((json.dumps(reply) + "\n").encode())
            self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class ControlServer:
    """The coordinator on a TCP port (every copy leader keeps one connection open)."""

    def __init__(self, coordinator: Coordinator, host: str = "0.0.0.0"):
        self.coordinator = coordinator
        self.server = _Server((host, 0), _Handler)
        self.server.coordinator = coordinator
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def address(self, host: str | None = None) -> str:
        return f"{host or socket.gethostname()}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class JobServices:
    """What a run with several copies of the state needs beside its ranks: the job's
    rendezvous store (a process of its own, orchestrator.train.store, so it outlives any
    rank) and the coordinator on a TCP port. `env` is what every rank needs to find them."""

    def __init__(self, copies: list[int], plan_dir: str, decide, quorum_s: float, host: str):
        import subprocess
        import sys

        self.store = subprocess.Popen([sys.executable, "-m", "orchestrator.train.store"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        port = int(self.store.stdout.readline())
        self.coordinator = Coordinator(copies, plan_dir, decide, quorum_s=quorum_s)
        self.server = ControlServer(self.coordinator, host="0.0.0.0" if host != "127.0.0.1" else host)
        self.env = {"ORCH_STORE": f"{host}:{port}", "ORCH_CONTROL": self.server.address(host)}

    def close(self) -> None:
        self.server.close()
        self.store.kill()
        self.store.wait()

"""The commit tree: per step, the copies' commits are summed on the way up a tree of copy
leaders of fan-in k, so the coordinator (launch/control.py) reads k messages a step instead
of R, and each leader that aggregates reads at most k. Torch-free: the coordinator, the
leaders (train/replicas.py) and the simulator (benchmarks/failover_sim.py) run this code.

Positions are the copies' places in the generation's data order. The coordinator's
children are positions 0..k-1; position i's children are k(i+1) .. k(i+1)+k-1 (a k-ary
heap hung under the coordinator), so the depth is about log_k R and each message names
its subtree's size, which the receiver checks against the tree.

Only commits travel up the tree; everything else (a failure report, a join, bye) goes
straight to the coordinator over each leader's own connection, which also carries the
coordinator's `report` push: when a change of membership begins, every copy not yet heard
from is told to send its commit to the coordinator directly, so a dead, hung or partitioned
aggregator strands nobody (its subtree re-homes to the root). An aggregator whose parent
went away re-sends its sum straight to the coordinator; a message an aggregator cannot take
(another generation, another step) is answered `rehome`, and the sender goes to the root.
"""
from __future__ import annotations

import math

import threading
from collections import Counter

from orchestrator.train.wire import finite

ROOT = -1  # the coordinator's position
REHOME = {"op": "rehome"}


def fan_in(copies: int, k: int = 16) -> int:
    """The tree's fan-in: flat (every leader to the coordinator) up to 64 copies, k above. At
    k=16 a level costs about 16 messages of one CPU's work (~0.5 ms here) and 12,500 copies
    take 4 levels (benchmarks/failover_sim.py prints the commit latency)."""
    return copies if copies <= 64 else k


def parent(pos: int, k: int) -> int:
    return pos // k - 1 if pos >= k else ROOT


def children(pos: int, R: int, k: int) -> range:
    lo = k * (pos + 1)
    return range(min(lo, R), min(lo + k, R))


def subtree(pos: int, R: int, k: int):
    """The positions under `pos`, itself included (level by level: contiguous ranges)."""
    lo = hi = pos
    while lo < R:
        yield from range(lo, min(hi, R - 1) + 1)
        lo, hi = k * (lo + 1), k * (hi + 1) + k - 1


def subtree_size(pos: int, R: int, k: int) -> int:
    lo, hi, n = pos, pos, 0
    while lo < R:
        n += min(hi, R - 1) - lo + 1
        lo, hi = k * (lo + 1), k * (hi + 1) + k - 1
    return n


REACH_PEERS = 4  # after a partition abort each leader tries this many copies on each side of it in the ring


def reach_peers(pos: int, R: int, k: int = REACH_PEERS) -> list[int]:
    """The positions a copy at `pos` of R tries on the data path after a partition abort: its ring
    neighbours, up to k on each side (every copy is tried by up to 2k others, whatever R)."""
    out = []
    for d in range(1, min(k, (R - 1) // 2 + (R - 1) % 2) + 1):
        for p in ((pos + d) % R, (pos - d) % R):
            if p != pos and p not in out:
                out.append(p)
    return out


def ancestors(pos: int, k: int):
    pos = parent(pos, k)
    while pos != ROOT:
        yield pos
        pos = parent(pos, k)


# Stragglers (launch/stragglers.py) need each copy's own work in a step ("busy", seconds)
# against the median over all copies. A sum up the tree carries that as a fixed-size summary,
# so a message stays O(1) however many copies it covers: a histogram of busy times (bins
# BUSY_BIN wide: the median within 5%), the SLOWEST copies by name (more stragglers than that
# at once are named over later steps) and the copies that were saving a checkpoint (not judged).
BUSY_BIN = 1.05
SLOWEST = 4


def _bin(seconds: float) -> int:
    return int(math.floor(math.log(max(seconds, 1e-6) / 1e-6, BUSY_BIN)))


def busy_of(msg: dict) -> dict | None:
    """The busy summary a commit carries: a sum's as it came, a leader's own from its `busy`
    and `saving`; None when it carries none (a launcher that does not watch stragglers)."""
    if "busy_hist" in msg:
        return {"hist": msg["busy_hist"], "slow": msg["busy_slow"], "saving": msg["busy_saving"]}
    if msg.get("busy") is None:
        return None
    copy, t = msg.get("copy"), float(msg["busy"])
    if msg.get("saving"):
        return {"hist": {}, "slow": [], "saving": [copy]}
    return {"hist": {str(_bin(t)): 1}, "slow": [[copy, t]], "saving": []}


def busy_ok(b: dict) -> bool:
    """Whether a summary is well formed (bounded sizes, finite non-negative times)."""
    try:
        return (all(int(k) >= 0 and isinstance(v, int) and v > 0 for k, v in b["hist"].items())
                and len(b["slow"]) <= SLOWEST and all(finite(t) and t >= 0 for _, t in b["slow"])
                and isinstance(b["saving"], list))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def valid_busy(msg: dict) -> bool:
    """Whether a commit's busy summary (if it carries one) is well formed."""
    try:
        b = busy_of(msg)
    except (TypeError, ValueError):
        return False
    return b is None or busy_ok(b)


def merge_busy(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    hist = dict(a["hist"])
    for k, v in b["hist"].items():
        hist[k] = hist.get(k, 0) + v
    slow = sorted(a["slow"] + b["slow"], key=lambda x: -x[1])[:SLOWEST]
    return {"hist": hist, "slow": slow, "saving": a["saving"] + b["saving"]}


def busy_fields(b: dict | None) -> dict:
    """A sum's message fields for its summary."""
    return {} if b is None else {"busy_hist": b["hist"], "busy_slow": b["slow"], "busy_saving": b["saving"]}


def lower_median(hist: dict) -> float | None:
    """The lower median of a busy histogram (the bin's centre), None under two copies."""
    n = sum(hist.values())
    if n < 2:
        return None
    want, seen = (n - 1) // 2 + 1, 0
    for k in sorted(hist, key=int):
        seen += hist[k]
        if seen >= want:
            return 1e-6 * BUSY_BIN ** (int(k) + 0.5)
    return None


class Aggregator:
    """One copy leader's part of the tree: it takes its own commit and its children's, and
    sends their sum up once the whole subtree is in; the answer goes back to each of them.
    A state machine like the Coordinator (the same ControlServer serves it).

    `up(body, on_answer)` sends to the parent (another leader's aggregator, or the coordinator);
    `root(body, on_answer)` straight to the coordinator; each calls `on_answer(answer)` later,
    with None when the connection failed."""

    def __init__(self, copy: int, up, root):
        self.copy, self.up, self.root = copy, up, root
        self.lock = threading.RLock()
        self.gen, self.kids, self.expected = None, {}, 1  # child copy -> its subtree size
        self.dropped: Counter = Counter()
        self._dropped = 0
        self._reset(None)

    def _reset(self, step) -> None:
        self.step, self.n, self.sums, self.waiting, self.sent = step, 0, [0.0, 0.0, 0.0], {}, False
        self.busy: dict | None = None

    def configure(self, gen: int, copies: list[int], k: int, pos: int | None = None) -> None:
        """The tree of generation `gen` (what was pending is told to go to the root)."""
        with self.lock:
            pending = list(self.waiting.values())
            R = len(copies)
            pos = copies.index(self.copy) if pos is None else pos
            self.gen, self.expected = gen, subtree_size(pos, R, k)
            self.kids = {copies[p]: subtree_size(p, R, k) for p in children(pos, R, k)}
            self._reset(None)
        for r in pending:
            r(REHOME)

    # ---- what the ControlServer calls ---------------------------------------------------
    def handle(self, msg: dict, reply) -> None:
        with self.lock:
            copy, n, step = msg.get("copy"), msg.get("n", 1), msg.get("step")
            want = 1 if copy == self.copy else self.kids.get(copy)
            sums = msg.get("sums")
            if (msg.get("op") != "commit" or want is None or n != want or not isinstance(step, int)
                    or not (isinstance(sums, list) and len(sums) == 3 and all(finite(x) for x in sums))
                    or not valid_busy(msg)):
                return self.drop("not_a_child_commit")
            if copy in self.waiting:
                return self.drop("duplicate")
            if msg.get("gen") != self.gen or self.sent or (self.step is not None and step != self.step):
                return reply(REHOME)  # not this aggregator's round: the coordinator decides
            self.step = step
            self.waiting[copy] = reply
            self.n += n
            self.sums = [a + b for a, b in zip(self.sums, sums)]
            self.busy = merge_busy(self.busy, busy_of(msg))
            if self.n < self.expected:
                return
            self.sent = True
            body = {"op": "commit", "copy": self.copy, "gen": self.gen, "step": step, "sums": self.sums,
                    "n": self.n, **busy_fields(self.busy)}
            gen = self.gen
        self.up(body, lambda ans: self._answered(gen, step, body, ans, upward=True))

    def _answered(self, gen: int, step: int, body: dict, answer, upward: bool) -> None:
        with self.lock:
            if gen != self.gen or step != self.step or not self.sent:
                return  # a round given up (a new generation was configured)
            if answer is None or answer.get("op") == "rehome":
                if upward:  # the parent went away or could not take it: straight to the coordinator
                    resend = True
                else:
                    answer, resend = REHOME, False  # the root too: each goes on its own
            else:
                resend = False
            if not resend:
                replies = list(self.waiting.values())
                self._reset(step + 1 if answer.get("op") == "commit" else None)
        if resend:
            return self.root(body, lambda ans: self._answered(gen, step, body, ans, upward=False))
        for r in replies:  # the same answer object to each: serialised once
            r(answer)

    def closed(self, copy: int) -> None:
        with self.lock:
            self.waiting.pop(copy, None)  # its loss is the coordinator's to see

    def tick(self) -> None:
        pass  # no deadline of its own: the coordinator's commit deadline and its push bound every wait

    def drop(self, reason: str) -> None:
        with self.lock:
            self.dropped[reason] += 1
            self._dropped += 1

    def dropped_total(self) -> int:
        return self._dropped

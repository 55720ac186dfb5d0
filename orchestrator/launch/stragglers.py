"""Stragglers: a copy of the model state persistently slower than the others. Torch-free.

Where it is seen: at the coordinator (launch/control.py), from the commit each copy's leader
sends every step. Not from the commit's arrival time: the copies average their gradients
before they commit, so every copy waits there for the slowest and all arrive together. Each
leader measures its copy's own work in the step (forward and backward, up to the cross-copy
all-reduce; the copy's ranks are in lockstep through the copy's own collectives) and sends
it with the commit (`busy`). The coordinator already holds every copy's commit of the step,
so this costs O(R) a step and no collective; up the commit tree (train/tree.py) each sum carries
a fixed-size summary (a histogram for the median, the few slowest copies by name), so no
message grows with R; the progress
beats (launch/progress.py) are files the launcher would have to read for all N ranks.

The rule: a copy whose work took more than `failover.straggler_margin` x the median over
the copies (and at least MIN_EXCESS_S more: timer noise on millisecond steps) in
`failover.straggler_steps` steps in a row is a straggler; it is named once. A step its copy
spent beside a checkpoint save (`saving`: copy 0 writes the checkpoint; an asynchronous
save shares its next steps) neither counts nor breaks the run of steps. With two copies the
median is the faster one's (the lower median), so the slower of two can be named.

A straggler is not a hang: it makes progress every step, so the progress deadline (at least
30 s, launch/progress.py) does not fire on it unless one of its steps takes longer than that.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.train import tree

MIN_EXCESS_S = 0.1  # a copy must be at least this much slower than the median, as well as by the margin


@dataclass
class Straggler:
    copy: int
    step: int  # the step whose commit made it a straggler
    busy_s: float  # its work in that step
    median_s: float  # the median over the copies in that step
    steps: int  # steps in a row it was past the margin

    @property
    def ratio(self) -> float:
        return self.busy_s / self.median_s if self.median_s > 0 else float("inf")


class Stragglers:
    def __init__(self, margin: float = 1.3, steps: int = 5):
        self.margin, self.steps = margin, steps
        self.streak: dict[int, int] = {}  # copy -> steps in a row past the margin
        self.named: set[int] = set()
        self.found: list[Straggler] = []  # named, not yet taken by the launcher

    def observe(self, step: int, busy: dict) -> None:
        """One committed step's busy summary (train/tree.busy_of, summed up the commit tree): a
        histogram of the copies' work for the median, the slowest copies by name, the copies that
        shared the step with a save. A copy not among the slowest is not past the margin."""
        median = tree.lower_median(busy["hist"])
        if median is None:
            return
        saving = set(busy["saving"])
        slow = {}
        for copy, t in busy["slow"]:
            if t > self.margin * median and t - median >= MIN_EXCESS_S:
                slow[copy] = t
        for copy in list(self.streak):
            if copy not in slow and copy not in saving:
                self.streak.pop(copy)
        for copy, t in slow.items():
            self.streak[copy] = self.streak.get(copy, 0) + 1
            if self.streak[copy] >= self.steps and copy not in self.named:
                self.named.add(copy)
                self.found.append(Straggler(copy, step, t, median, self.streak[copy]))

    def take(self) -> list[Straggler]:
        out, self.found = self.found, []
        return out


def name(run_dir, s: Straggler, nodes: list, fo, spares: int, say) -> bool:
    """A straggler found: named in failover.json and TensorBoard (plan/events.py), status.json
    and on the console. Returns whether its node(s) are to be evicted: failover.evict_stragglers
    with a warm spare copy waiting; without one it is kept and the run says so (evicting it would
    shrink the job, and a slow copy still trains)."""
    from orchestrator.launch.status import read_status, write_status
    from orchestrator.rundir import events

    evict = bool(fo.evict_stragglers and spares and nodes)
    action = ("evicted: its node(s) treated as lost, a warm spare takes its place" if evict else
              "kept: failover.evict_stragglers is off" if not fo.evict_stragglers else
              "kept: no warm spare waiting (cluster.spare_nodes), and evicting it would shrink the job")
    what = (f"copy {s.copy} on node(s) {nodes} is a straggler: its step took {s.busy_s:.3f} s against the copies' "
            f"median {s.median_s:.3f} s ({s.ratio:.2f}x, over failover.straggler_margin={fo.straggler_margin:g}) "
            f"for {s.steps} steps in a row up to step {s.step + 1}; {action}")
    events.record(run_dir, {"mode": "straggler", "reason": "straggler", "copy": s.copy, "nodes": nodes, "step": s.step,
                            "busy_s": s.busy_s, "median_s": s.median_s, "ratio": s.ratio, "steps": s.steps,
                            "evicted": evict, "action": action})
    named = read_status(run_dir).get("stragglers", [])
    write_status(run_dir, stragglers=named + [{"copy": s.copy, "nodes": nodes, "step": s.step, "ratio": s.ratio,
                                               "evicted": evict, "what": what}])
    say(f"STRAGGLER: {what}")
    return evict

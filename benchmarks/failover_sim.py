"""The failover control plane at 2k-100k ranks, on a virtual clock (issue #24).

The REAL coordinator (launch/control.Coordinator, its clock made virtual) and the REAL in-place
decision (launch/inplace.InPlace: the planner re-plans every new generation, written to a
temporary run directory) with the copy leaders emulated by a discrete-event model. Every
message goes through the real wire format (train/wire.py: signed, checked, parsed) and the
coordinator's real code; the CPU time the server side takes (thread time) is measured and charged
to a single server on the virtual clock, so queueing at R leaders is real. What the model does
not run, it states (CONSTANTS): the network hop, a crashed peer's reset, SLURM's node-down
time, a restart's relaunch, the state transfer rate, the store's service rate (measured here with
torch's TCPStore when torch is there).

Per step every live copy computes `step_s` (the plan's predicted step), meets the others in
the gradient all-reduce, and its leader sends its commit; a failure breaks the all-reduce
(the survivors see it after a reset, or after failover.timeout_s for a silent peer) and they
report, the supervisor may see it (a process gone, SLURM's node state), the coordinator
decides, the new generation rebuilds its groups (3N store operations, replicas.py, over the job
store's shards: the busiest one's share, plan/goodput.rebuild_s) and
finishes the step: the survivors kept their gradients, only the lost copies' micro-batches are
recomputed (plan/goodput.recompute, the plan's definition), or the whole step where the
decision redoes it. Scenarios: crash, node, hang, straggler, two, flap, drain, supervisor (its
node lost: the standby takes over through the real lease, `takeover`), partition; and the replay of Llama 3's 54 days on 16,384 GPUs (419 unexpected
interruptions, Llama 3 paper section 3.3.4, Table 5) for ETTR.

    python benchmarks/failover_sim.py [--configs 16k-128,16k-8,100k-128,100k-8] [--json] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import heapq
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.launch.control import Coordinator  # noqa: E402
from orchestrator.launch.inplace import copy_size  # noqa: E402
from orchestrator.launch.stragglers import Stragglers  # noqa: E402
from orchestrator.launch.srun import SrunWorkers  # noqa: E402
from orchestrator import rundir  # noqa: E402
from orchestrator.plan import goodput  # noqa: E402
from orchestrator.plan.goodput import LLAMA3_TABLE5  # noqa: E402,F401 (the failure mix: one definition, the plan's)
from orchestrator.train import tree, wire  # noqa: E402
from orchestrator.train.tree import Aggregator  # noqa: E402

CONSTANTS = {  # stated, not emulated
    "fabric_hop_s": 20e-6,  # one way, a leader to the coordinator over the data-center network (TCP)
    "reset_s": 1e-3,  # a crashed process's peers see their connections reset
    "poll_s": 2.0,  # launcher.poll_s: the supervisor sees a process gone, a node drained
    "node_down_s": 30.0,  # SLURM marks a dead or unreachable node down (SlurmdTimeout-like)
    "restart_load_s": goodput.RELAUNCH_S,  # every rank started again after a restart, before the checkpoint read
    "state_gbps": 25.0,  # GB/s at which a spare receives a healthy copy's state
    "store_ops_s": goodput.STORE_OPS_S,  # the store's service rate (replaced by the measured one when torch is there)
    "repair_s": goodput.REPAIR_S,  # a failed node is back, as a spare, after this (the plan's)
    "probe_s": 1.0,  # after a partition abort a leader tries its ring neighbours on the data path: its connect timeout
}
PHASE = 0.4  # where in its step a scenario's failure strikes (Sim.inject)
L3 = ["training.seq_len=8192", "training.recompute=full", "layout.stage_layers=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]",
      "model=llama3_405b", "layout.tp=8", "layout.pp=16", "layout.dp_shard=1"]
CONFIGS = {  # name: overrides (copies of 128 GPUs: Llama 3 405B's TP8 PP16; of 8: Llama 3 8B TP8)
    "16k-128": L3 + ["cluster.nodes=2048", "layout.dp=128", "training.global_batch=2048"],
    "100k-128": L3 + ["cluster.nodes=12544", "layout.dp=784", "training.global_batch=12544"],
    "16k-8": ["model=llama3_8b", "training.seq_len=8192", "cluster.nodes=2048", "layout.tp=8", "layout.dp=2048",
              "layout.dp_shard=1", "training.global_batch=8192"],
    "100k-8": ["model=llama3_8b", "training.seq_len=8192", "cluster.nodes=12500", "layout.tp=8", "layout.dp=12500",
               "layout.dp_shard=1", "training.global_batch=50000"],
    "2k-8": ["model=llama3_8b", "training.seq_len=8192", "cluster.nodes=256", "layout.tp=8", "layout.dp=256",
             "layout.dp_shard=1", "training.global_batch=1024"],
}
SCENARIOS = ("crash", "node", "hang", "straggler", "two", "flap", "drain", "supervisor", "partition", "cut",
             "aggregator")
BOUND = [True]  # the coordinator's cross-copy bound (plan/timeouts.collective_bound_s); --no-bound: the collective timeout only
# Llama 3 405B pre-training, 54 days: 419 unexpected interruptions by cause (Table 5), and the kind of
# failure each is in this model: LLAMA3_TABLE5, imported from the planner (orchestrator/plan/goodput.py),
# whose goodput prediction weighs the same mix.


@functools.lru_cache(maxsize=None)
def plan_of(name: str):
    from orchestrator import compose, make_plan

    plan = make_plan(compose(CONFIGS[name] + ["launcher=slurm"]))  # the job supervises itself (srun.py)
    if not plan.valid:
        raise SystemExit(f"{name}: " + "; ".join(str(e) for e in plan.errors))
    return plan


ROOT = tree.ROOT
FAN_IN = [0]  # the commit tree's fan-in (0: tree.fan_in's)
SHIM = r"""#!{python}
# SLURM's commands for benchmarks/failover_sim.py: the node states of its timeline at its virtual time.
import json, os, sys
folder = os.environ["ORCH_SIM_SLURM"]
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if name == "scontrol":
    if args[:2] == ["show", "config"]:
        print("SlurmdTimeout           = {slurmd} sec")
    elif args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))
    sys.exit(0)
if name == "squeue":
    print("RUNNING")
    sys.exit(0)
now = float(open(os.path.join(folder, "now")).read())
timeline = json.load(open(os.path.join(folder, "timeline.json")))
nodes = args[args.index("-n") + 1].split(",") if "-n" in args else list(timeline)
fmt = args[args.index("-o") + 1] if "-o" in args else "%N %T"
out = []
for n in nodes:
    state, reason = "allocated", "none"
    for t, st in timeline.get(n, ()):
        if t <= now:
            state = st
            reason = "maintenance" if st.startswith("drain") else "Not responding" if st.startswith("down") else "none"
    out.append(fmt.replace("%N", n).replace("%T", state).replace("%E", reason))
print("\n".join(out))
"""


def slurm_shims(folder: Path) -> Path:
    """sinfo, scontrol and squeue on PATH that replay the simulation's node states at its virtual
    time (folder/now and folder/timeline.json, written by the simulator before each poll)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sinfo", "scontrol", "squeue"):
        path = bin_dir / name
        path.write_text(SHIM.format(python=sys.executable, slurmd=int(CONSTANTS["node_down_s"])))
        path.chmod(0o755)
    return bin_dir


class VirtualTime:
    """The `time` the SLURM wait loop sees (orchestrator.launch.srun.time): sleeping runs the
    simulation up to the virtual time it wakes at."""

    def __init__(self, sim):
        self.sim = sim

    def monotonic(self) -> float:
        return self.sim.now

    def time(self) -> float:
        return 1.7e9 + self.sim.now

    def sleep(self, dt: float) -> None:
        self.sim.run_until(self.sim.now + dt)


class SimProc:
    """The srun step: running until every leader is done or told to exit."""

    def __init__(self, sim):
        self.sim, self.pid = sim, -1

    def poll(self):
        return 0 if self.sim.finished() else None


class CoordinatorOnServer:
    """The coordinator as the supervisor's thread sees it (SrunWorkers.wait calls `lost`): its
    work queues on the root's one server like a leader's message."""

    def __init__(self, sim):
        self.sim = sim

    @property
    def current(self):
        return self.sim.coord.current

    @property
    def finished(self):
        return self.sim.coord.finished

    def lost(self, copies) -> None:
        self.sim.sup_lost(copies)

    def in_collective(self, step: int, waited_s: float) -> bool:
        """The watcher's beats (SrunWorkers._in_collective) judged on the root's server (answered later)."""
        self.sim._on_server(ROOT, self.sim.coord.in_collective, step, waited_s)
        return False

    def take_stragglers(self) -> list:
        found = self.sim.coord.take_stragglers()
        self.sim.named += [s.copy for s in found]  # what the supervisor names (stragglers.name)
        return found


class SimSrunWorkers(SrunWorkers):
    """SLURM's workers with the step and the job's services replaced by the simulation: `start`
    is the simulator's; `wait` (the node-state polling, the hand-over to the coordinator) is
    SrunWorkers' own. The warm spare copies the simulator keeps are the only other change."""

    def __init__(self, sim, spec, run_dir: Path):
        super().__init__(spec, run_dir, [f"sim{i:05d}" for i in range(spec.cluster.nodes)])
        self.sim = sim

    def waiting_spares(self) -> set[int]:
        return set(self.sim.spare_ids)

    def assign(self, copies, plan, plan_dir) -> None:
        self.sim.spare_ids -= set(copies)

    def say(self, text: str) -> None:
        self.sim.events.append({"t": self.sim.now, "say": text})

    def signal(self, sig: int) -> None:  # the emulated ranks dump no stacks (and no real process is signalled)
        self.sim.events.append({"t": self.sim.now, "signal": int(sig)})

    def stop(self) -> None:  # the step ends: every emulated leader is told to exit
        self.sim.stopped = self.sim.now

    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict, policy=None) -> None:
        self.current, self.policy, self.plan_dir = list(nodes[: self.spec.cluster.nodes]), policy, Path(plan_dir)
        self.services = type("Services", (), {"coordinator": CoordinatorOnServer(self.sim), "close": lambda s: None})()
        per = self.sim.size // self.spec.hardware.gpus_per_node or 1  # nodes per copy (ranks laid out node by node)
        self.node_copies = {n: [k // per] if self.sim.size >= self.spec.hardware.gpus_per_node else
                            sorted({(k * self.spec.hardware.gpus_per_node + g) // self.sim.size
                                    for g in range(self.spec.hardware.gpus_per_node)})
                            for k, n in enumerate(self.current)}
        self.timeouts(self.sim.plan.to_json())  # the hang deadline and the settle window wait() uses (the plan's)
        self.proc = SimProc(self.sim)
        self.sim.begin(policy)


class Sim:
    """One scenario on one configuration: the real supervisor loop (supervisor.supervise) with
    SLURM's wait loop (srun.SrunWorkers.wait) on a virtual clock, the real coordinator and
    the leaders' real commit tree (train/tree.py); leaders and their traffic emulated."""

    def __init__(self, name: str, scenario: str, spares: int = 2, seed: int = 0, steps: int | None = None):
        self.plan, self.scenario = plan_of(name), scenario
        self.R, self.size = self.plan.layout.dp_replicate, copy_size(self.plan)
        self.N = self.R * self.size
        self.step_s = self.plan.step.to_json()["wall_s"]
        fo = self.plan.spec.failover
        self.timeout_s, self.quorum_s = fo.timeout_s, fo.quorum_s
        self.rng, self.key, self.now = random.Random(seed), secrets.token_bytes(32), 0.0
        self.q: list = []
        self.n = 0
        self.free: dict[int, float] = {}  # server (ROOT or an aggregating leader) -> when its CPU is free
        self.busy = 0.0
        self.dir = Path(tempfile.mkdtemp(prefix="failover_sim_"))
        self.n_spares = spares
        self.spare_ids = set(range(self.R, self.R + spares))
        self.conn = {c: secrets.token_hex(8) for c in range(self.R + spares)}
        self.broken: dict[int, tuple[str, float]] = {}
        self.drained: set[int] = set()
        self.lat: list[float] = []
        self.exited: dict[int, str] = {}
        self.events: list[dict] = []
        self.t_fail: float | None = None
        self.detected: float | None = None
        self.first_after: float | None = None
        self.before: tuple = (-1, 0.0)  # (step, when) of the last commit the first generation got
        self.first_after_step = -1
        self.steps = steps or (20 if scenario == "flap" else 12 if self.R < 5000 else 8)  # failure at step 3
        if scenario == "drain" and not steps:  # SLURM's wait sees it at its next poll, then gathers the settle window
            wait = self.plan.blast_radius["timeouts"]["settle_s"] + self.plan.spec.launcher.poll_s
            self.steps = max(self.steps, 4 + int(2 * wait / self.step_s))
        self.slow: dict[int, float] = {}
        self.named: list[int] = []  # copies the supervisor named stragglers
        self.cut: set[int] = set()  # copies cut off from the others on the data path, their leaders' connections up
        self.cut_at = 0.0
        self.probed: set[int] = set()  # generations aborted as a partition: their leaders try their ring neighbours
        self.beats: dict = {}  # copy -> its leader's last progress beat (launch/progress.Beat), read by the watcher
        self.aborted: dict[int, float] = {}  # generation -> when the coordinator aborted its collectives
        self.how: str | None = None  # how the first change was detected: abort (known) or found out
        self.timed_out = 0  # failed reports a collective's own timeout sent (not an abort, not a reset)
        self.stopped = None
        self.last_step = -1
        self.committed_before = 0
        self.gen_of: dict[int, int] = {}
        self.done_step: dict[int, int] = {}  # leader -> the last step it saw committed
        self.pending: dict[int, tuple] = {}  # leader -> (request id, body) of its commit in flight
        self.direct: dict[int, int] = {}  # leader -> the generation it was told to report straight to the root in
        self.req = 0
        self.rounds: dict = {}
        self.timeline: dict[str, list] = {}
        self.max_wait = 0.0  # the longest any member's leader waited for an answer (a spare's join aside)
        self._last: tuple = (None, b"")
        self.coord = None
        # the job's store shards the launchers start (rundir.store_shards): the rebuild and the abort use them
        self.shards = rundir.store_shards(self.plan.world_size, fo.store_shards)
        self._began: set[int] = set()  # the copies that started the first new generation
        self.phase: dict[str, float] = {}  # when (virtual s) each phase of the first recovery ended (phases())
        # (gen, step) -> the work a copy does for the step its generation was formed in when the survivors kept
        # their gradients: only the lost copies' micro-batches, then the all-reduce (plan/goodput.recompute)
        self.redo: dict[tuple, dict] = {}

    # ---- the supervisor: the real loop, SLURM's commands shimmed -----------------------------
    def run(self) -> dict:
        from orchestrator.launch import srun, supervisor

        folder = self.dir / "slurm"
        bin_dir = slurm_shims(folder)
        self._write_slurm()
        from orchestrator.launch import progress

        saved = srun.time, os.environ.get("PATH"), os.environ.get("ORCH_SIM_SLURM")
        srun.time = VirtualTime(self)
        progress_time, progress_read = progress.time, progress.read
        progress.time, progress.read = VirtualTime(self), self.read_beats  # the beats the leaders write, in memory
        gc.collect()
        gc.disable()  # a pause of the simulator's heap (every leader's state) is no one server's: not charged
        os.environ["PATH"], os.environ["ORCH_SIM_SLURM"] = f"{bin_dir}{os.pathsep}{saved[1]}", str(folder)
        try:
            workers = SimSrunWorkers(self, self.plan.spec, self.dir / "run")
            (self.dir / "run").mkdir()
            with contextlib.redirect_stdout(sys.stderr):  # what the supervisor prints stays off --json's output
                self.code = supervisor.supervise(self.plan, self.dir / "run", workers, say=lambda *a, **k: None)
        finally:
            gc.enable()
            srun.time = saved[0]
            progress.time, progress.read = progress_time, progress_read
            os.environ["PATH"] = saved[1]
            if saved[2] is None:
                os.environ.pop("ORCH_SIM_SLURM", None)
        self.workers = workers
        return self.result()

    def _write_slurm(self) -> None:
        folder = self.dir / "slurm"
        (folder / "now").write_text(repr(self.now))
        (folder / "timeline.json").write_text(json.dumps(self.timeline))

    def node_of(self, copy: int) -> str:
        per = max(1, self.size // self.plan.spec.hardware.gpus_per_node)
        return f"sim{copy * per:05d}"

    def begin(self, policy) -> None:
        """The step starts (SrunWorkers.start): the coordinator, the leaders, the warm spares."""
        self.policy = policy
        self.coord = Coordinator(list(range(self.R)), str(self.dir), self._decide, quorum_s=self.quorum_s,
                                 commit_timeout_s=self.timeout_s, clock=lambda: self.now, fan_in=FAN_IN[0],
                                 push=lambda c, m: self._out.append(("push", c, m)),
                                 stragglers=Stragglers(),  # each commit's busy summary, as the runtime sends
                                 abort=self._abort,
                                 collective_s=self.plan.blast_radius["timeouts"]["collective_bound_s"] if BOUND[0]
                                 else None)
        self.k = self.coord.fan_in
        self.agg, self.trees = {}, {}
        for c in range(self.R):
            self._configure(c, 0, list(range(self.R)))
        for s in sorted(self.spare_ids):  # warm spares wait to be admitted
            self.coord.expect(s)
            self.send_root(s, {"op": "join", "copy": s, "gen": -1, "now": False}, 0.0)
        for c in range(self.R):
            self.at(0.0, self.start, c, 0, 0)
        self.at(0.1, self.tick)
        self.at(0.0, self.inject)

    def beat(self, c: int, step: int, phase: str) -> None:
        """Leader c's progress beat (train/world.beat), kept in memory: the watcher reads it through
        progress.read (patched in run()), the real progress.watch/hung decide."""
        from orchestrator.launch.progress import Beat

        self.beats[c] = Beat(c, step, phase == "end", 1.7e9 + self.now, c, self.node_of(c), c, phase == "wait")

    def read_beats(self, run_dir, pids=None) -> dict:
        return {c: b for c, b in self.beats.items() if c not in self.exited and (pids is None or c in pids)}

    def _abort(self, gen: int, dead: list[int]) -> None:
        """The coordinator aborts generation gen's cross-copy collectives (the job's store sets the key on
        each shard, one operation each, and wakes every rank: then a hop): every copy waiting in one
        reports now."""
        if gen != self.coord.current.gen or gen in self.aborted:
            return  # (an old generation released once its change concluded: nobody is left in it)
        self.aborted[gen] = self.now
        t = self.now + self.shards / CONSTANTS["store_ops_s"] + self.hop
        if not dead:  # a partition: each leader tries its peers on the data path before it reports (`unreached`)
            t += CONSTANTS["probe_s"]
            self.probed.add(gen)
        self.phase.setdefault("abort", t)
        for (g, step), rd in list(self.rounds.items()):
            if g == gen and not rd.get("done"):
                for c in list(rd["arrived"]):
                    if c not in self.broken:
                        self._fail_at(rd, c, g, step, t, force=True)

    def _decide(self, alive, dead, joiners, step):
        if self.t_fail is not None:
            self.phase.setdefault("decided", self.now)
        return self.policy.decide(alive, dead, joiners, step)

    def finished(self) -> bool:
        live = [c for c in self.coord.current.copies if c not in self.broken and c not in self.exited]
        return self.coord.current.copies == [] or (all(self.gen_of.get(c) == self.coord.current.gen and
                                                        self.done_step.get(c, -1) + 1 >= self.steps for c in live)
                                                    and self.coord.changing is None)

    # ---- the event queue -----------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self.n += 1
        heapq.heappush(self.q, (t, self.n, fn, args))

    def run_until(self, t_end: float) -> None:
        while self.q and self.q[0][0] <= t_end:
            t, _, fn, args = heapq.heappop(self.q)
            self.now = max(self.now, t)
            fn(*args)
        self.now = max(self.now, t_end)
        if not self.q and self.now > 2 * self.t_end:
            c = self.coord
            raise RuntimeError(f"{self.scenario}: the simulation stalled at {self.now:.1f} s (no event left): generation "
                               f"{c.current.gen}, changing {c.changing}, {len(c.reporting)} reporting, {len(c.waiting)} "
                               f"waiting, {c.counted} counted at step {c.step}, dead {sorted(c.dead)[:5]}, "
                               f"{len(self.pending)} leaders waiting, e.g. {list(self.pending.items())[:3]}")
        self._write_slurm()

    # ---- the leaders ---------------------------------------------------------------------------
    def _configure(self, c: int, gen: int, copies: list[int]) -> None:
        """Leader c learns generation `gen`'s tree (Replicas.build does it at runtime): whether it
        aggregates, and for whom (on its own CPU: what it held is told to go to the root)."""
        if gen not in self.trees:
            self.trees = {g: t for g, t in self.trees.items() if g >= gen - 1}
            self.trees[gen] = (list(copies), {x: i for i, x in enumerate(copies)})
        copies, pos = self.trees[gen]
        R, k = len(copies), self.k
        if c not in pos:
            return
        if k < R and tree.children(pos[c], R, k):
            if c not in self.agg:
                self.agg[c] = Aggregator(c, functools.partial(self._up, c), functools.partial(self._to_root, c))
            self._on_server(c, self.agg[c].configure, gen, copies, k, pos[c])
        elif c in self.agg:
            self._on_server(c, self.agg.pop(c).configure, gen, copies, k, pos[c])

    def parent_of(self, c: int, gen: int) -> int:
        copies, pos = self.trees[gen]
        up = tree.parent(pos[c], self.k) if c in pos else ROOT
        return ROOT if up == ROOT else copies[up]

    def start(self, c: int, gen: int, step: int) -> None:
        if c in self.broken or c in self.exited or step >= self.steps:
            return
        self.gen_of[c] = gen
        if self.t_fail is not None and gen == 1 and c not in self._began:  # the new generation's groups built
            self._began.add(c)
            self.phase["started"] = max(self.phase.get("started", 0.0), self.now)
        self.beat(c, step, "begin")
        f = self.slow.get(c, 1.0) if step < self.slow_until else 1.0
        work = self.redo[(gen, step)]["seconds"] if (gen, step) in self.redo else self.step_s
        self.at(self.now + work * f * (1 + 0.002 * self.rng.random()), self.at_allreduce, c, gen, step)

    def _round(self, gen: int, step: int) -> dict:
        key = (gen, step)
        if key not in self.rounds:
            members = set(self.coord.current.copies) if gen == self.coord.current.gen else set()
            self.rounds = {k: v for k, v in self.rounds.items() if k[0] >= gen - 1}
            self.rounds[key] = {"members": members, "arrived": {}, "reported": set(), "reported_at": {}, "sent": 0.0,
                                "got": set()}
        return self.rounds[key]

    def at_allreduce(self, c: int, gen: int, step: int) -> None:
        if c in self.broken:
            return
        rd = self._round(gen, step)
        rd["arrived"][c] = self.now
        if self.t_fail is not None and gen == 0 and c not in self.broken:  # a survivor at the step's boundary
            self.phase["boundary"] = max(self.phase.get("boundary", 0.0), self.now)
        self.beat(c, step, "wait")
        if gen in self.aborted:  # aborted already: it leaves the collective at once
            return self._fail_at(rd, c, gen, step, self.now, force=True)
        broken = [b for b in (*self.broken, *self.cut) if b in rd["members"]]  # O(failures), not O(R)
        if c in self.cut:  # cut off: it waits on every other copy (its leader still answers the coordinator)
            broken = [b for b in rd["members"] if b != c][:1] or [c]
        if broken:
            return self._fail_later(rd, c, gen, step, broken)
        if len(rd["arrived"]) == len(rd["members"]):
            rd["done"] = True  # the all-reduce finished: a later failure does not touch this step
            for m in rd["members"]:
                t = self.now + 2e-4 * self.rng.random()  # the copy's own agreement and its leader
                rd["sent"] = max(rd["sent"], t)
                self.at(t, self.commit, m, gen, step)
            if self.scenario == "aggregator" and step == 3 and self.t_fail is None:  # dies with every sum on the way
                self.at(self.now + 1e-4, self.fail, [self.agg_victim()], "node")

    def commit(self, c: int, gen: int, step: int) -> None:
        if c in self.broken:
            return
        f = self.slow.get(c, 1.0) if step < self.slow_until else 1.0  # its own work: a slow copy's is longer
        body = {"op": "commit", "copy": c, "gen": gen, "step": step, "sums": [2.0 + 0.001 * step, 1.0, 0.0],
                "busy": f * self.step_s * (0.9 + 0.02 * self.rng.random()), "saving": False}
        self.req += 1
        rid = self.req
        self.pending[c] = (rid, body, self.now)
        if c in self.agg and self.direct.get(c) != gen:  # its own commit into its own aggregator (no hop)
            return self.at(self.now, self._serve_local, c, body, rid)
        up = self.parent_of(c, gen)
        if self.direct.get(c) == gen or up == ROOT:
            return self.send_root(c, body, self.now, rid)
        self._send(up, c, body, self.now, functools.partial(self.receive, c, rid))

    def _fail_later(self, rd, c, gen, step, broken) -> None:
        """The all-reduce cannot finish: after a reset (a crash) or the collective's timeout (a silent
        peer), this copy's leader reports the failure straight to the coordinator (sooner when the
        coordinator aborts the generation first: _abort)."""
        kind, tf = self.broken.get(broken[0], ("cut", self.cut_at))
        delay = CONSTANTS["reset_s"] if kind == "crash" else self.timeout_s
        self._fail_at(rd, c, gen, step, max(self.now, tf) + delay, by="reset" if kind == "crash" else "timeout")

    def _fail_at(self, rd, c, gen, step, t, force=False, by="abort") -> None:
        """Copy c's leader reports the failed step at t (once; `force`: an abort, sooner than planned);
        `by`: what ended its collective (abort, reset, timeout)."""
        if c in rd["reported"] and not force:
            return
        if c in rd["reported"] and rd["reported_at"].get(c, 0.0) <= t:
            return  # it reports sooner already
        rd["reported"].add(c)
        rd.setdefault("reported_at", {})[c] = t
        body = {"op": "failed", "copy": c, "gen": gen, "step": step, "sums": [0.0, 0.0, 0.0]}
        if gen in self.probed and gen in self.trees:  # what its data path reached (train/replicas.py `reach`)
            copies, pos = self.trees[gen]
            peers = [copies[p] for p in tree.reach_peers(pos[c], len(copies))] if c in pos else []
            body["unreached"] = [m for m in peers if m in self.cut or c in self.cut]
            body["reached"] = [m for m in peers if m not in self.cut and c not in self.cut]
        self.req += 1
        self.pending[c] = (self.req, body, t)
        self.at(t, self._report_failed, c, self.req, body, by)

    def _report_failed(self, c: int, rid: int, body: dict, by: str = "abort") -> None:
        if c in self.broken or self.pending.get(c, (None,))[0] != rid:
            return  # superseded (an abort made it report sooner)
        self.timed_out += by == "timeout"
        if self.how is None:
            self.how = "abort" if body["gen"] in self.aborted else "found out"
        self.send_root(c, body, self.now, rid)

    def receive(self, c: int, rid: int, answer) -> None:
        if c in self.broken or c in self.exited or c not in self.pending or self.pending[c][0] != rid:
            return  # an answer it no longer waits for (it went to the root instead)
        _, body, t_asked = self.pending[c]
        if answer is None or answer.get("op") in ("rehome", "report"):  # its aggregator is gone or could not take it
            return self.send_root(c, body, self.now)
        self.pending.pop(c)
        if body["op"] != "join":  # a warm spare waits to be needed, by design without end
            self.max_wait = max(self.max_wait, self.now - t_asked)
        op = answer["op"]
        if op == "commit":
            gen, step = self.gen_of[c], answer["step"]
            rd = self.rounds.get((gen, step))
            if rd is not None:
                rd["got"].add(c)
                if len(rd["got"]) == len(rd["members"]):
                    self.lat.append(self.now - rd["sent"])
            if self.t_fail is not None and self.first_after is None and gen > 0:
                self.first_after, self.first_after_step = self.now, step
            if gen == 0 and step >= self.before[0]:
                self.before = (step, self.now)
            self.last_step = max(self.last_step, step)
            self.done_step[c] = step
            self.beat(c, step, "end")  # the step's end: its commit granted (train/trainer.py)
            return self.start(c, gen, step + 1)
        if op == "reform":
            if self.t_fail is not None and answer["gen"] == 1:  # the decision reached this leader
                self.phase["told"] = max(self.phase.get("told", 0.0), self.now)
            self._configure(c, answer["gen"], answer["copies"])
            kept = answer.get("kept")
            if kept and (answer["gen"], answer["step"]) not in self.redo:  # the plan's definition of the work
                self.redo[(answer["gen"], answer["step"])] = goodput.recompute(self.plan, len(kept["lost"]),
                                                                              len(answer["copies"]))
            new = c in answer["new"]
            state_s = self.plan.blast_radius["checkpoint_bytes"] / self.N / (CONSTANTS["state_gbps"] * 1e9) if new else 0.0
            # the groups rebuilt on the store's shards at once (the plan's definition: goodput.rebuild_s)
            rebuild_s = goodput.rebuild_s(len(answer["copies"]), self.size, self.shards, CONSTANTS["store_ops_s"])
            return self.at(self.now + rebuild_s + state_s, self.start, c, answer["gen"], answer["step"])
        self.exited[c] = answer.get("reason", "")

    def on_push(self, c: int, msg: dict) -> None:
        """The coordinator's `report`: a change began; what waits in the tree goes to the root."""
        if c in self.broken or c in self.exited:
            return
        self.direct[c] = msg["gen"]
        if c in self.pending and self.pending[c][1]["op"] == "commit" and self.pending[c][1]["gen"] == msg["gen"]:
            self.send_root(c, self.pending[c][1], self.now)

    # ---- messages, and the servers (the root, each aggregating leader: one CPU each) ----------
    def send_root(self, c: int, body: dict, t: float, rid: int | None = None) -> None:
        if rid is None:  # a new request for the same body
            self.req += 1
            rid = self.req
            self.pending[c] = (rid, body, self.pending.get(c, (0, 0, t))[2])
        self._send(ROOT, c, body, t, functools.partial(self.receive, c, rid))

    def _send(self, dst: int, src: int, body: dict, t: float, on_answer) -> None:
        if self._cut(src) or (dst != ROOT and self._cut(dst)):
            if dst != ROOT and self.broken.get(dst, ("",))[0] == "crash":  # its peer's connection reset
                self.at(t + CONSTANTS["reset_s"], on_answer, None)
            return  # lost (a dead or partitioned end: nobody answers)
        line = wire.encode(self.key, body, self.conn[src], 1)
        self.at(t + self.hop, self.serve, dst, src, line, on_answer)

    def _cut(self, c: int) -> bool:
        return c in self.broken

    def _on_server(self, sid: int, fn, *args) -> None:
        """Run `fn` as server `sid` would, when it is free; its replies leave when it is done."""
        if self.free.get(sid, 0.0) > self.now:  # busy: it waits its turn (the clock does not jump)
            return self.at(self.free[sid], self._on_server, sid, fn, *args)
        self._out = []
        start = self.now
        w0 = time.thread_time()  # CPU time: a busy shared machine's descheduling is not charged
        fn(*args)
        dt = time.thread_time() - w0
        self.busy += dt
        self.free[sid] = start + dt
        out, self._out = self._out, []
        for item in out:
            if item[0] == "push":
                self.at(self.free[sid] + self.hop, self.on_push, item[1], item[2])
            else:
                on_answer, answer, local = item
                self.at(self.free[sid] + (0.0 if local else self.hop), on_answer, answer)
        if self.t_fail is not None and self.detected is None and self.coord.changing is not None:
            self.detected = start - self.t_fail

    def serve(self, sid: int, src: int, line: bytes, on_answer) -> None:
        if sid != ROOT and (sid in self.broken or sid not in self.agg):
            if sid not in self.broken:  # no longer an aggregator: it says go to the root
                self.at(self.now + self.hop, on_answer, tree.REHOME)
            return
        self._on_server(sid, self._serve, sid, line, on_answer)

    def _serve(self, sid: int, line: bytes, on_answer, local: bool = False) -> None:
        nonce, seq, body = wire.decode(self.key, line)  # what ControlServer._line does

        def reply(answer, on_answer=on_answer):  # may be called later, from another server call
            if self._last[0] is not answer:  # as ControlServer._reply: serialised once, signed per leader
                self._last = (answer, wire.canonical(answer))
            wire.encode(self.key, self._last[1], nonce, seq)
            self._out.append((on_answer, answer, local))
        (self.coord if sid == ROOT else self.agg[sid]).handle(body, reply)

    def _serve_local(self, c: int, body: dict, rid: int) -> None:
        if c in self.agg and c not in self.broken:
            line = wire.encode(self.key, body, self.conn[c], 1)
            self._on_server(c, self._serve, c, line, functools.partial(self.receive, c, rid), True)
        else:
            self.send_root(c, body, self.now, rid)

    def _up(self, c: int, body: dict, on_answer) -> None:
        """Aggregator c's sum to its parent (called on c's server: leaves when c is done)."""
        up = self.parent_of(c, self.agg[c].gen)
        self._after(c, lambda: self._send(up, c, body, self.now, functools.partial(self._on_agg, c, on_answer)))

    def _to_root(self, c: int, body: dict, on_answer) -> None:
        self._after(c, lambda: self._send(ROOT, c, body, self.now, functools.partial(self._on_agg, c, on_answer)))

    def _after(self, sid: int, fn) -> None:
        self._out.append((lambda _: fn(), None, True))

    def _on_agg(self, c: int, on_answer, answer) -> None:
        if c in self.broken or c not in self.agg:
            return
        self._on_server(c, on_answer, answer)

    def tick(self):
        self._on_server(ROOT, self.coord.tick)
        if self.now < self.t_end and not self.finished():
            self.at(self.now + 0.1, self.tick)

    @property
    def hop(self) -> float:
        return CONSTANTS["fabric_hop_s"]

    @property
    def t_end(self) -> float:
        return self.steps * self.step_s + 3 * (self.timeout_s + self.quorum_s) + 60

    # ---- the failures ---------------------------------------------------------------------------
    slow_until = 0

    def agg_victim(self) -> int:
        """An aggregator with a subtree below it (position 1: k children, each with its own)."""
        return self.coord.current.copies[1 if self.k < self.R else self.R - 1]

    def inject(self) -> None:
        s, t0 = self.scenario, (3 + PHASE) * self.step_s
        victim = self.R - 1
        if s == "straggler":
            self.slow, self.slow_until = {victim: 1.5}, 8
            return
        if s in ("supervisor", "aggregator"):
            return
        if s == "flap":  # down, back, down again: SLURM's states replayed by sinfo
            n = self.node_of(victim)
            self.timeline[n] = [[t0 + CONSTANTS["node_down_s"], "down*"], [t0 + 60, "idle"],
                                [t0 + 90, "down*"], [t0 + 120, "idle"]]
        self.at(t0, self.fail, [victim, 0] if s == "two" else [victim], "node" if s in ("flap", "two") else s)

    def fail(self, copies: list[int], kind: str) -> None:
        if self.t_fail is None:
            self.t_fail, self.committed_before = self.now, self.last_step + 1
        for c in copies:
            n = self.node_of(c)
            if kind == "drain":  # planned: the copy is healthy and goes on until dismissed
                self.timeline[n] = [[self.now, "draining"]]
            elif kind == "node" and n not in self.timeline:  # SLURM marks it down after SlurmdTimeout
                self.timeline[n] = [[self.now + CONSTANTS["node_down_s"], "down*"]]
        if kind == "drain":
            self.drained |= set(copies)
            return
        if kind == "cut":  # the data path only: alive, beating, its leader's connection up; SLURM sees nothing
            self.cut |= set(copies)
            self.cut_at = self.now
            for (gen, step), rd in list(self.rounds.items()):  # copies already waiting in the all-reduce
                if set(copies) & rd["members"] and not rd.get("done"):
                    for c in list(rd["arrived"]):
                        self._fail_later(rd, c, gen, step, copies)
            return
        for c in copies:  # a partitioned node stays up for SLURM (and a crash leaves it up)
            self.broken[c] = (kind, self.now)
            if kind == "partition" and c in self.beats:  # cut off, alive: it blocks in the collective and beats so
                self.beat(c, self.beats[c].step, "wait")
        for (gen, step), rd in list(self.rounds.items()):  # survivors already waiting in the all-reduce
            if set(copies) & rd["members"] and not rd.get("done"):
                for c in list(rd["arrived"]):
                    if c not in self.broken:
                        self._fail_later(rd, c, gen, step, copies)
        if kind == "crash":  # the processes are gone: the kernel closes the leader's connections
            for c in copies:
                self.at(self.now + CONSTANTS["reset_s"], self.sup_closed, c)
        elif kind in ("node", "partition"):  # the leader's node (node_of) silent: its connection unanswered
            from orchestrator.plan.timeouts import keepalive_s

            for c in copies:
                self.at(self.now + keepalive_s(), self.sup_closed, c)
        for c in copies:  # children waiting on a crashed aggregator see the reset
            if c in self.agg and kind == "crash":
                pass  # (handled when their messages meet the dead end: _send)

    def sup_lost(self, copies):
        """SrunWorkers.wait hands a node's copies to the coordinator (on the root's server)."""
        self._on_server(ROOT, self.coord.lost, copies)

    def sup_closed(self, c):
        self._on_server(ROOT, self.coord.closed, c)

    # ---- the outcome ----------------------------------------------------------------------------
    def phases(self) -> dict:
        """Where the first recovery's time went, each from the fault (virtual s): detected (the
        coordinator's change began), abort (the survivors' pending collectives aborted), boundary (the
        last survivor reached the step's cross-copy collective: the step in flight's own work),
        decided (the coordinator's decision), told (the last leader has it: the coordinator's answers
        sent), started (the new generation's groups rebuilt on the store's shards, a newcomer's state
        received: the step starts again), committed (the redone step committed: recovery_s). Then
        rebuild_s (told to started), redo_s (started to
        committed: the step in flight finished: with the gradients kept, only the lost copies'
        micro-batches recomputed, recomputed_mb of them a data rank, and the all-reduce,
        plan/goodput.recompute; else the whole step) and control_s: from when the loss is known and the
        survivors are at the boundary to the new generation's start (what detection after the
        boundary, the report, the decision and the rebuild add; the step's own work is not in it)."""
        if self.t_fail is None or self.first_after is None:
            return {}
        at = {"detected": None if self.detected is None else self.t_fail + self.detected, **self.phase,
              "committed": self.first_after}
        out = {k: round(v - self.t_fail, 3) for k, v in at.items() if v is not None}
        if "told" in at and "started" in at:
            out["rebuild_s"] = round(at["started"] - at["told"], 3)
            out["redo_s"] = round(self.first_after - at["started"], 3)
            known = max(x for x in (at["detected"], at.get("boundary"), self.t_fail) if x is not None)
            out["control_s"] = round(at["started"] - known, 3)
        return out

    def result(self) -> dict:
        lat = sorted(self.lat) or [0.0]
        decisions = self.coord.history
        evicted = sorted({c for d in decisions for c in d["dead"]} - set(self.broken) - self.drained - self.cut)
        waiting = len(self.coord.waiting)
        out = {"scenario": self.scenario, "ranks": self.N, "copies": self.R, "fan_in": self.k,
               "step_s": round(self.step_s, 3),
               "commit_p50_s": lat[len(lat) // 2], "commit_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
               "detected_s": None if self.detected is None else round(self.detected, 3),
               "recovered": True, "recovery_s": None, "steps_lost": 0, "healthy_evicted": len(evicted),
               "generations": self.coord.current.gen, "left_waiting": waiting,
               "max_wait_s": round(self.max_wait, 3), "supervisor_exit": self.code,
               "dropped": self.coord.counts()["dropped_total"], "steps_done": self.last_step + 1, "steps": self.steps,
               "server_cpu_s": round(self.busy, 3), "stragglers_named": sorted(self.named),
               "survivors_released": self.how, "collectives_timed_out": self.timed_out, "step_stopped": self.stopped,
               "declared_cut": sorted({c for d in decisions for c in ((d.get("aborted") or {}).get("cut") or ())})}
        if self.scenario == "supervisor":  # the coordinator dies with its node: the standby takes over
            t = takeover(self.plan, (3 + PHASE) * self.step_s, self.dir / "lease_run")
            every = self.plan.blast_radius["checkpoint_interval_s"] or 0  # the restart after it: stated
            out.update(detected_s=round(t["detected_s"], 3), recovered_by="takeover", generation=t["generation"],
                       old_fenced=t["old_fenced"], modelled="restart",
                       recovered=t["generation"] == 2 and t["old_fenced"] and self.code == 0,
                       recovery_s=round(t["detected_s"] + CONSTANTS["restart_load_s"], 3),
                       steps_lost=round(every / 2 / self.step_s, 1))
        elif self.scenario != "straggler":
            out["steps_lost"] = max(0, self.committed_before - decisions[0]["step"]) if decisions else None
            out["recovered"] = (self.first_after is not None and self.last_step + 1 >= self.steps and waiting == 0
                                and self.code == 0)
            out["recovery_s"] = None if self.first_after is None else round(self.first_after - self.t_fail, 3)
            # how much later the first step the new generation commits does than it would have without
            # the failure (the time the run lost): from the first generation's last commit, less a step each
            out["phases"] = self.phases()
            first = min(self.redo.items(), default=None)  # the first recovery: what it recomputed
            if out["phases"]:
                out["phases"]["recomputed_mb"] = first[1]["microbatches"] if first else self.plan.layout.microbatches
            out["redo"] = "kept" if first else "step"
            out["control_s"] = out["phases"].get("control_s")
            out["delay_s"] = None if self.first_after is None else round(
                self.first_after - self.before[1] - (self.first_after_step - self.before[0]) * self.step_s, 3)
        else:
            out["recovered"] = self.coord.current.gen == 0 and self.last_step + 1 >= self.steps and self.code == 0
        return out


def takeover(plan, t_fail: float, run_dir: Path) -> dict:
    """The supervisor's node lost at `t_fail` on a virtual clock, driven through the real lease
    (launch/lease.py) and the standby's real watch (launch/batch.watch): the active supervisor renews
    every period until its node dies; the standby looks every period, half a period after the
    renewals, from its own start; when the lease has expired it claims the next generation. The old
    holder, were it to come back, is fenced (its renewal fails). What follows (the ranks started
    again from the checkpoint level) is the restart's, stated (CONSTANTS, plan/goodput.py)."""
    from orchestrator.launch.batch import watch
    from orchestrator.launch.lease import Lease
    from orchestrator.plan.timeouts import lease_period_s, lease_s

    run_dir.mkdir(parents=True, exist_ok=True)
    timeout = lease_s(plan.spec.failover, plan.spec.launcher.poll_s)
    period, clock = lease_period_s(timeout), {"now": 0.0, "renew": 0.0}
    now = lambda: clock["now"]  # noqa: E731
    active = Lease(run_dir, timeout, holder="supervisor", host="node first", clock=now)
    standby = Lease(run_dir, timeout, holder="standby", host="node last", clock=now)
    active.acquire()

    def sleep(s: float) -> None:  # the virtual clock moves on; the active supervisor renews meanwhile
        until = clock["now"] + s
        while clock["renew"] + period <= min(until, t_fail):
            clock["renew"] += period
            clock["now"] = clock["renew"]
            assert active.renew()
        clock["now"] = until
        if until > t_fail + 10 * timeout:
            raise RuntimeError(f"no takeover {10 * timeout:g} s after the supervisor's node was lost")
    sleep(period / 2)
    seen = watch(standby, run_dir, period, sleep=sleep)
    taken = clock["now"]
    if seen is None or not standby.acquire(after=seen):
        raise RuntimeError("the standby did not take over")
    return {"detected_s": taken - t_fail, "generation": standby.generation, "old_fenced": not active.renew()}


def wait_bound_s(name: str) -> float:
    """The longest any wait may take: the plan's ladder (collective timeout, quorum, settle window,
    plan/timeouts.py) plus SLURM naming a dead node and the supervisor's poll (CONSTANTS, the
    shims'). Printed beside each scenario's detection, longest wait and recovery."""
    plan = plan_of(name)
    fo, t = plan.spec.failover, plan.blast_radius["timeouts"]
    return fo.timeout_s + fo.quorum_s + t["settle_s"] + CONSTANTS["node_down_s"] + plan.spec.launcher.poll_s


def scenario(name: str, kind: str, seed: int = 0) -> dict:
    sim = Sim(name, kind, seed=seed)
    try:
        return {"config": name, **sim.run(), "wait_bound_s": round(wait_bound_s(name), 3)}
    except RuntimeError as e:  # a stall is a result: not recovered, and what was left waiting
        return {"config": name, "scenario": kind, "ranks": sim.N, "copies": sim.R, "recovered": False,
                "error": str(e)[:2000], "step_s": round(sim.step_s, 3)}
    finally:  # the run's files (SLURM folder, commits, lease) are read back within the run only
        shutil.rmtree(sim.dir, ignore_errors=True)


def tally(events: list[tuple], costs: dict, spares: int, restart_s: float, supervisor_s: float, repair_s: float,
          copies: int, end_s: float | None = None) -> dict:
    """The replay's arithmetic on given costs. `events`: (time, kind, supervisor_hit) in time order;
    `costs`: {kind: seconds the run loses when the copies recover in place (a scenario's delay_s), or
    None when the scenario did not recover (it is charged a restart, never nothing)}. Each in-place
    failure takes a warm spare and sends its node to repair for `repair_s`; one that finds none left
    shrinks the copies in place (the same loss, and the job runs one copy short, 1/copies of its
    speed lost, until a node is back from repair: a node back fills a shortage first, then the
    pool); the supervisor's node lost costs `supervisor_s` (goodput.supervisor_lost_s: its standby
    takes over, the run restarts). Shortages still open at `end_s` are charged up to it."""
    back: list[float] = []  # when the failed nodes are back from repair
    short: list[float] = []  # when each open shortage (a copy missing, no spare) began
    pool, lost, restarts, shrinks, unrecovered, short_s = spares, 0.0, 0, 0, 0, 0.0

    def returns(until: float) -> None:
        nonlocal pool, lost, short_s
        for b in sorted(x for x in back if x <= until):
            back.remove(b)
            if short:  # it rejoins the job where a copy is missing
                gap = b - short.pop(0)
                short_s += gap
                lost += gap / copies
            else:
                pool += 1
    for t, kind, supervisor_hit in events:
        returns(t)
        cost = costs.get(kind)
        if supervisor_hit or cost is None:
            restarts += 1
            unrecovered += cost is None and not supervisor_hit
            lost += supervisor_s if supervisor_hit else restart_s
            continue
        lost += cost
        back.append(t + repair_s)
        if pool == 0:  # no spare: the survivors go on with one copy fewer until a node is back
            shrinks += 1
            short.append(t)
        else:
            pool -= 1
    if end_s is not None:
        returns(end_s)
        for since in short:
            short_s += end_s - since
            lost += (end_s - since) / copies
    return {"lost_s": lost, "restarts": restarts, "no_spare": shrinks, "unrecovered": unrecovered,
            "short_copy_hours": short_s / 3600}


def replay(rows: list[dict], name: str, days: float = 54.0, spares: int | None = None, seed: int = 0) -> dict:
    """Llama 3's 419 interruptions over 54 days on 16,384 GPUs (the same mix at the same rate per GPU
    for another size): each costs its kind's simulated delay (delay_s: how much later the first step
    the new generation commits does than it would have without the failure; a kind whose scenario
    did not recover: a restart); with no warm spare left the copies shrink in place, the supervisor's
    node (a node or partition failure one time in `nodes`) is taken over by the standby and the run
    restarts from the last checkpoint level (goodput.supervisor_lost_s with the takeover's detection
    the supervisor scenario drove; tally). ETTR = productive time / wall time, less the checkpoint overhead; both from the plan
    (plan/goodput.py: the snapshot level it picks). Warm spares: the plan's (goodput.spare_copies)."""
    plan, rng = plan_of(name), random.Random(seed)
    g = goodput.goodput(plan)
    by_kind = {r["scenario"]: r for r in rows if r["config"] == name}
    T = days * 86400.0
    if spares is None:  # the plan's warm spare copies (sized to the repair pipeline unless cluster.spare_nodes)
        spares = goodput.spare_copies(plan)[0]
    mix = [k for _, n, k in LLAMA3_TABLE5 for _ in range(n)]  # 419 on 16,384 GPUs: scaled to this size
    kinds = [rng.choice(mix) for _ in range(round(len(mix) * plan.world_size / 16384))] if plan.world_size != 16384 \
        else mix
    times = sorted(rng.uniform(0, T) for _ in kinds)
    rng.shuffle(kinds)
    # the node (and, one time in `nodes`, the supervisor on it) gone: plan/goodput.SUPERVISOR_KINDS
    events = [(t, k, k in goodput.SUPERVISOR_KINDS and rng.random() < 1.0 / plan.spec.cluster.nodes)
              for t, k in zip(times, kinds)]
    # the scenarios strike the copy's first node (its leader's); a node or partition failure strikes
    # another node of the copy (nodes per copy - 1 times in nodes per copy): the copy's ranks stall
    # short of the collective, what the hang scenario measures (the leader's connection stays up)
    per = max(1, copy_size(plan) // plan.spec.hardware.gpus_per_node)
    events = [(t, "hang" if k in ("node", "partition") and rng.random() >= 1.0 / per else k, hit)
              for t, k, hit in events]
    costs = {k: (r["delay_s"] if r.get("recovered") and r.get("delay_s") is not None else None)
             for k, r in by_kind.items()}
    restart = CONSTANTS["node_down_s"] + g["restart_base_s"]  # restarted, the state read back, half an interval redone
    sup = by_kind.get("supervisor", {})  # the takeover the scenario drove through the real lease (else the plan's L)
    supervisor = goodput.supervisor_lost_s(plan, g["restart_base_s"], CONSTANTS["node_down_s"],
                                           sup.get("detected_s") if sup.get("recovered") else None)
    out = tally(events, costs, spares, restart, supervisor, CONSTANTS["repair_s"], plan.layout.dp_replicate, T)
    overhead = g["checkpoint_overhead"]  # the blocking part of the plan's checkpoint level
    ettr = (T - out["lost_s"]) / T * (1 - overhead)
    predicted = g["predicted_ettr"]
    return {"replay": "llama3_54_days", "config": name, "interruptions": len(kinds), "days": days,
            "warm_spare_copies": spares, "spare_gpu_share": round(spares / (plan.layout.dp_replicate + spares), 4),
            "restarts": out["restarts"], "no_spare": out["no_spare"], "unrecovered": out["unrecovered"],
            "no_spare_share": round(out["no_spare"] / max(1, len(kinds)), 4),
            "short_copy_hours": round(out["short_copy_hours"], 1),
            "plan_no_spare_chance": round(g["no_spare_chance"], 4), "lost_hours": round(out["lost_s"] / 3600, 2),
            "restart_s": round(restart, 1), "supervisor_lost_s": round(supervisor, 1),
            "plan_supervisor_lost_s": round(g["supervisor_lost_s"], 1), "checkpoint_level": g["checkpoint_level"],
            "checkpoint_interval_s": round(g["checkpoint_interval_s"], 1), "checkpoint_overhead": round(overhead, 5),
            "ettr": round(ettr, 4), "plan_predicted_ettr": round(predicted, 4),
            "plan_minus_sim_points": round(100 * (predicted - ettr), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="16k-128,100k-128,16k-8,100k-8")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides added to every configuration (e.g. failover.store_shards=1: one store server)")
    ap.add_argument("--no-bound", action="store_true",
                    help="no cross-copy bound (the collective timeout alone: how a cut went before it)")
    ap.add_argument("--store-ops-s", type=float, default=None,
                    help="each store shard's service rate (default: measured here; the plan's is "
                         f"{goodput.STORE_OPS_S:g}): to compare runs on a loaded machine")
    a = ap.parse_args()
    BOUND[0] = not a.no_bound
    for name in CONFIGS:
        CONFIGS[name] = CONFIGS[name] + a.set
    CONSTANTS["store_ops_s"] = a.store_ops_s or measured_store_ops_s() or CONSTANTS["store_ops_s"]
    rows = []
    for n in a.configs.split(","):
        for k in a.scenarios.split(","):
            rows.append(scenario(n, k))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: a 100k-rank scenario takes minutes
    needed = {kind for _, _, kind in LLAMA3_TABLE5}  # the kinds the failure mix replays
    replays = [replay(rows, n) for n in a.configs.split(",") if set(a.scenarios.split(",")) >= needed]
    if a.json:
        print(json.dumps({"constants": CONSTANTS, "scenarios": rows, "replays": replays}, indent=1))
        return
    print("constants (stated; store_ops_s measured when torch is there, unless --store-ops-s):",
          ", ".join(f"{k}={v:g}" for k, v in CONSTANTS.items()))
    cols = ["config", "scenario", "ranks", "copies", "detected_s", "recovered", "recovery_s", "delay_s",
            "control_s", "survivors_released", "wait_bound_s", "max_wait_s", "steps_lost", "healthy_evicted",
            "commit_p50_s", "commit_p99_s", "step_s"]
    print(" ".join(f"{c:>15s}" for c in cols))
    for r in rows:
        print(" ".join(f"{_fmt(r.get(c)):>15s}" for c in cols))
    print("where each recovery's time went (s from the fault; Sim.phases), store shards per config:",
          {n: rundir.store_shards(plan_of(n).world_size, plan_of(n).spec.failover.store_shards)
           for n in a.configs.split(",")})
    keys = ["detected", "abort", "boundary", "decided", "told", "started", "committed", "rebuild_s", "redo_s",
            "recomputed_mb", "control_s"]
    print(" ".join(f"{c:>10s}" for c in ["config", "scenario"] + keys))
    for r in rows:
        if r.get("phases"):
            print(" ".join(f"{_fmt(x):>10s}" for x in [r["config"], r["scenario"]] + [r["phases"].get(k) for k in keys]))
    for r in replays:
        print(json.dumps(r))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def measured_store_ops_s(n: int = 3000) -> float | None:
    """Sequential get/set against torch's TCPStore on loopback (a lower bound: one client)."""
    try:
        from datetime import timedelta

        import torch.distributed as dist
    except ImportError:
        return None
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    t0 = time.perf_counter()
    for i in range(n):
        client.set(f"k{i}", b"x" * 64)
        client.get(f"k{i}")
    return 2 * n / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()

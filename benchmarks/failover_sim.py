"""The failover control plane at 2k-100k ranks, on a virtual clock (issue #24).

The REAL coordinator (launch/control.Coordinator, its clock made virtual) and the REAL in-place
decision (launch/inplace.InPlace: the planner re-plans every new generation, written to a
temporary run directory) with the copy leaders emulated by a discrete-event model. Every
message goes through the real wire format (train/wire.py: signed, checked, parsed) and the
coordinator's real code; the CPU time the server side takes (thread time) is measured and charged
to a single server on the virtual clock, so queueing at R leaders is real. What the model does
not run, it states (CONSTANTS): the network hop, a crashed peer's reset, SLURM's node-down
and requeue times, the state transfer rate, the store's service rate (measured here with
torch's TCPStore when torch is there).

Per step every live copy computes `step_s` (the plan's predicted step), meets the others in
the gradient all-reduce, and its leader sends its commit; a failure breaks the all-reduce
(the survivors see it after a reset, or after failover.timeout_s for a silent peer) and they
report, the supervisor may see it (a process gone, SLURM's node state), the coordinator
decides, the new generation rebuilds its groups (3N store operations, replicas.py) and
redoes the step. Scenarios: crash, node, hang, straggler, two, flap, drain, supervisor,
partition; and the replay of Llama 3's 54 days on 16,384 GPUs (419 unexpected
interruptions, Llama 3 paper section 3.3.4, Table 5) for ETTR.

    python benchmarks/failover_sim.py [--configs 16k-128,16k-8,100k-128,100k-8] [--json]
"""
from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.launch.control import Coordinator  # noqa: E402
from orchestrator.launch.inplace import InPlace, copy_size  # noqa: E402
from orchestrator.train import wire  # noqa: E402

CONSTANTS = {  # stated, not emulated
    "fabric_hop_s": 20e-6,  # one way, a leader to the coordinator over the data-center network (TCP)
    "reset_s": 1e-3,  # a crashed process's peers see their connections reset
    "poll_s": 2.0,  # launcher.poll_s: the supervisor sees a process gone, a node drained
    "node_down_s": 30.0,  # SLURM marks a dead or unreachable node down (SlurmdTimeout-like)
    "requeue_s": 300.0,  # the job requeued and started again (the supervisor's node lost)
    "restart_load_s": 120.0,  # every rank started and the checkpoint loaded after a restart
    "state_gbps": 25.0,  # GB/s at which a spare receives a healthy copy's state
    "store_ops_s": 50_000.0,  # the store's service rate (replaced by the measured one when torch is there)
    "repair_s": 4 * 3600.0,  # a failed node is back, as a spare, after this
}
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
SCENARIOS = ("crash", "node", "hang", "straggler", "two", "flap", "drain", "supervisor", "partition")
# Llama 3 405B pre-training, 54 days: 419 unexpected interruptions by cause (Table 5), and the kind of
# failure each is in this model.
LLAMA3_TABLE5 = [("faulty GPU", 148, "crash"), ("GPU HBM3 memory", 72, "crash"), ("software bug", 54, "crash"),
                 ("network switch/cable", 35, "partition"), ("host maintenance", 32, "drain"),
                 ("GPU SRAM memory", 19, "crash"), ("GPU system processor", 17, "crash"), ("NIC", 7, "partition"),
                 ("NCCL watchdog timeouts", 7, "hang"), ("silent data corruption", 6, "crash"),
                 ("GPU thermal interface and sensor", 6, "crash"), ("SSD", 3, "node"), ("power supply", 3, "node"),
                 ("server chassis", 2, "node"), ("IO expansion board", 2, "node"), ("dependency", 2, "crash"),
                 ("CPU", 2, "node"), ("system memory", 2, "node")]


@functools.lru_cache(maxsize=None)
def plan_of(name: str):
    from orchestrator import compose, make_plan

    plan = make_plan(compose(CONFIGS[name]))
    if not plan.valid:
        raise SystemExit(f"{name}: " + "; ".join(str(e) for e in plan.errors))
    return plan


class SimInPlace(InPlace):
    """The real decision; only the re-plan for a given number of copies is remembered (the planner
    is deterministic), so a replay does not plan the same layout twice."""

    _plans: dict = {}

    def _replan(self, copies: int):
        key = (id(self.plan.spec), copies)
        if key not in self._plans:
            self._plans[key] = super()._replan(copies)
        return self._plans[key]


class Sim:
    """One scenario on one configuration: leaders, supervisor and server on a virtual clock."""

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
        self.server_free, self.server_busy = 0.0, 0.0
        self.dir = tempfile.mkdtemp(prefix="failover_sim_")
        self.coord = Coordinator(list(range(self.R)), self.dir, self._decide, quorum_s=self.quorum_s,
                                 commit_timeout_s=self.timeout_s, clock=lambda: self.now)
        self.policy = SimInPlace(self.plan, Path(self.dir), 0, self)
        self.spare_ids = set(range(self.R, self.R + spares))
        self.conn = {c: [secrets.token_hex(8), 0] for c in range(self.R + spares)}
        self.broken: dict[int, tuple[str, float]] = {}
        self.drained: set[int] = set()
        self.rounds: dict = {}
        self.lat: list[float] = []
        self.exited: dict[int, str] = {}
        self.events: list[dict] = []
        self.t_fail: float | None = None
        self.detected: float | None = None
        self.first_after: float | None = None
        self.steps = steps or (20 if scenario == "flap" else 12 if self.R < 5000 else 8)  # failure at step 3
        self.slow: dict[int, float] = {}
        self.last_step = -1
        self.committed_before = 0
        self.gen_of: dict[int, int] = {}
        self._out: list = []
        self._last: tuple = (None, b"")

    # ---- what InPlace asks of its workers ---------------------------------------------------
    def say(self, text: str) -> None:
        self.events.append({"t": self.now, "say": text})

    def waiting_spares(self) -> set[int]:
        return set(self.spare_ids)

    def lost_nodes(self) -> list:
        return sorted(self.broken)

    def assign(self, copies, plan, plan_dir) -> None:
        self.spare_ids -= set(copies)

    def _decide(self, alive, dead, joiners, step):
        return self.policy.decide(alive, dead, joiners, step)

    # ---- the event queue -----------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self.n += 1
        heapq.heappush(self.q, (t, self.n, fn, args))

    def run(self) -> dict:
        for s in sorted(self.spare_ids):  # warm spares wait to be admitted
            self.coord.expect(s)
            self.send(s, {"op": "join", "copy": s, "gen": -1, "now": False}, 0.0)
        for c in range(self.R):
            self.at(0.0, self.start, c, 0, 0)
        self.at(0.1, self.tick)
        self.at(0.0, self.inject)
        while self.q:
            t, _, fn, args = heapq.heappop(self.q)
            self.now = max(self.now, t)
            fn(*args)
        return self.result()

    # ---- the leaders ---------------------------------------------------------------------------
    def start(self, c: int, gen: int, step: int) -> None:
        if c in self.broken or c in self.exited:
            return
        if step >= self.steps:
            return
        self.gen_of[c] = gen
        f = self.slow.get(c, 1.0) if step < self.slow_until else 1.0
        self.at(self.now + self.step_s * f * (1 + 0.002 * self.rng.random()), self.at_allreduce, c, gen, step)

    def _round(self, gen: int, step: int) -> dict:
        key = (gen, step)
        if key not in self.rounds:
            members = set(self.coord.current.copies) if gen == self.coord.current.gen else set()
            self.rounds = {k: v for k, v in self.rounds.items() if k[0] >= gen - 1}
            self.rounds[key] = {"members": members, "arrived": {}, "reported": set(), "sent": 0.0, "got": set()}
        return self.rounds[key]

    def at_allreduce(self, c: int, gen: int, step: int) -> None:
        if c in self.broken:
            return
        rd = self._round(gen, step)
        rd["arrived"][c] = self.now
        broken = [b for b in self.broken if b in rd["members"]]  # O(failures), not O(R)
        if broken:
            return self._fail_later(rd, c, gen, step, broken)
        if len(rd["arrived"]) == len(rd["members"]):
            rd["done"] = True  # the all-reduce finished: a later failure does not touch this step
            for m in rd["members"]:
                t = self.now + 2e-4 * self.rng.random()  # the copy's own agreement and its leader
                rd["sent"] = max(rd["sent"], t)
                loss = 2.0 + 0.001 * step
                self.send(m, {"op": "commit", "copy": m, "gen": gen, "step": step, "sums": [loss, 1.0, 0.0]}, t)

    def _fail_later(self, rd, c, gen, step, broken) -> None:
        """The all-reduce cannot finish: after a reset (a crash) or the collective's timeout (a silent
        peer), this copy's leader reports the failure."""
        if c in rd["reported"]:
            return
        rd["reported"].add(c)
        kind, tf = self.broken[broken[0]]
        delay = CONSTANTS["reset_s"] if kind == "crash" else self.timeout_s
        t = max(self.now, tf) + delay
        self.send(c, {"op": "failed", "copy": c, "gen": gen, "step": step, "sums": [0.0, 0.0, 0.0]}, t)

    def send(self, c: int, body: dict, t: float) -> None:
        if c in self.broken and self.broken[c][0] == "partition":
            return  # lost in the partition
        nonce, seq = self.conn[c]
        self.conn[c][1] = seq + 1
        line = wire.encode(self.key, body, nonce, seq + 1)
        self.at(t + self.hop, self.serve, c, line)

    def receive(self, c: int, answer: dict) -> None:
        if c in self.broken or c in self.exited:
            return
        op = answer["op"]
        if op == "commit":
            gen, step = self.gen_of[c], answer["step"]
            rd = self.rounds.get((gen, step))
            if rd is not None:
                rd["got"].add(c)
                if len(rd["got"]) == len(rd["members"]):
                    self.lat.append(self.now - rd["sent"])
            if self.t_fail is not None and self.first_after is None and gen > 0:
                self.first_after = self.now
                if self.scenario == "flap":  # the node comes back, then dies again while it waits to join
                    self.at(self.now + 2 * self.step_s, self.rejoin)
                    self.at(self.now + 6 * self.step_s, self.fail, [self.R + 9], "crash")
            self.last_step = max(self.last_step, step)
            return self.start(c, gen, step + 1)
        if op == "reform":
            new = c in answer["new"]
            state_s = self.plan.blast_radius["checkpoint_bytes"] / self.N / (CONSTANTS["state_gbps"] * 1e9) if new else 0.0
            rebuild_s = 3 * len(answer["copies"]) * self.size / CONSTANTS["store_ops_s"]
            return self.at(self.now + rebuild_s + state_s, self.start, c, answer["gen"], answer["step"])
        self.exited[c] = answer.get("reason", "")

    # ---- the server and the supervisor (one server: its measured CPU time queues) ---------------
    def _on_server(self, fn, *args) -> None:
        """Run `fn` as the server would, when the server is free; its replies leave when it is done."""
        self._out = []
        start = max(self.now, self.server_free)
        self.now = start
        w0 = time.thread_time()  # CPU time: a busy shared machine's descheduling is not charged
        fn(*args)
        dt = time.thread_time() - w0
        self.server_busy += dt
        self.server_free = start + dt
        for c, answer in self._out:
            self.at(self.server_free + self.hop, self.receive, c, answer)
        if self.t_fail is not None and self.detected is None and self.coord.changing is not None:
            self.detected = start - self.t_fail

    def serve(self, c: int, line: bytes) -> None:
        self._on_server(self._serve, c, line)

    def _serve(self, c: int, line: bytes) -> None:
        nonce, seq, body = wire.decode(self.key, line)  # what ControlServer._line does
        if nonce != self.conn[c][0]:
            raise AssertionError("nonce")

        def reply(answer, c=c, seq=seq):  # may be called later, from another server call
            if self._last[0] is not answer:
                self._last = (answer, wire.canonical(answer))
            wire.encode(self.key, self._last[1], nonce, seq)
            self._out.append((c, answer))
        self.coord.handle(body, reply)

    def tick(self):
        self._on_server(self.coord.tick)
        if self.now < self.t_end:
            self.at(self.now + 0.1, self.tick)

    @property
    def hop(self) -> float:
        return CONSTANTS["fabric_hop_s"]

    @property
    def t_end(self) -> float:
        return self.steps * self.step_s + 3 * (self.timeout_s + self.quorum_s) + 60

    # ---- the failures ---------------------------------------------------------------------------
    slow_until = 0

    def inject(self) -> None:
        s, t0 = self.scenario, 3 * self.step_s + 0.4 * self.step_s
        victim = self.R - 1
        if s == "straggler":
            self.slow, self.slow_until = {victim: 1.5}, 8
            return
        if s == "supervisor":
            return
        self.at(t0, self.fail, [victim, 0] if s == "two" else [victim], "node" if s == "flap" else
                "crash" if s == "two" else s)

    def fail(self, copies: list[int], kind: str) -> None:
        if self.t_fail is None:
            self.t_fail, self.committed_before = self.now, self.last_step + 1
        if kind == "drain":  # planned: the copy is healthy and keeps going until dismissed
            self.drained |= set(copies)
            return self.at(self.now + CONSTANTS["poll_s"], self.sup_lost, copies)
        for c in copies:
            self.broken[c] = (kind, self.now)
        for (gen, step), rd in list(self.rounds.items()):  # survivors already waiting in the all-reduce
            if set(copies) & rd["members"] and not rd.get("done"):
                for c in list(rd["arrived"]):
                    if c not in self.broken:
                        self._fail_later(rd, c, gen, step, copies)
        if kind == "crash":  # the launcher sees the processes gone and ends the copy: its connection closes
            for c in copies:
                self.at(self.now + CONSTANTS["poll_s"], self.sup_closed, c)
        if kind in ("node", "partition"):
            self.at(self.now + CONSTANTS["node_down_s"], self.sup_lost, copies)

    def rejoin(self) -> None:
        """The node is back: a new copy on it joins now (flap)."""
        new = self.R + 9
        self.conn[new] = [secrets.token_hex(8), 0]
        self.coord.expect(new)
        self.send(new, {"op": "join", "copy": new, "gen": -1, "now": True}, self.now)

    def sup_lost(self, copies):
        """The supervisor's side (its replies go to the leaders waiting, as the server's do)."""
        self._on_server(self.coord.lost, copies)

    def sup_closed(self, c):
        self._on_server(self.coord.closed, c)

    # ---- the outcome ----------------------------------------------------------------------------
    def result(self) -> dict:
        lat = sorted(self.lat) or [0.0]
        decisions = self.coord.history
        evicted = sorted({c for d in decisions for c in d["dead"]} - set(self.broken) - self.drained)
        waiting = len(self.coord.waiting)
        out = {"scenario": self.scenario, "ranks": self.N, "copies": self.R, "step_s": round(self.step_s, 3),
               "commit_p50_s": lat[len(lat) // 2], "commit_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
               "detected_s": None if self.detected is None else round(self.detected, 3),
               "recovered": True, "recovery_s": None, "steps_lost": 0, "healthy_evicted": len(evicted),
               "generations": self.coord.current.gen, "left_waiting": waiting,
               "dropped": self.coord.counts()["dropped_total"], "steps_done": self.last_step + 1,
               "server_cpu_s": round(self.server_busy, 3)}
        if self.scenario == "supervisor":  # the coordinator dies with its node: requeue, restart (modelled)
            every = self.plan.blast_radius["checkpoint_interval_s"] or 0
            out.update(detected_s=CONSTANTS["node_down_s"], modelled=True,
                       recovery_s=CONSTANTS["node_down_s"] + CONSTANTS["requeue_s"] + CONSTANTS["restart_load_s"],
                       steps_lost=round(every / 2 / self.step_s, 1))
        elif self.scenario != "straggler":
            out["steps_lost"] = max(0, self.committed_before - decisions[0]["step"]) if decisions else None
            out["recovered"] = self.first_after is not None and self.last_step + 1 >= self.steps and waiting == 0
            out["recovery_s"] = None if self.first_after is None else round(self.first_after - self.t_fail, 3)
        else:
            out["recovered"] = self.coord.current.gen == 0 and self.last_step + 1 >= self.steps
        return out


def scenario(name: str, kind: str, seed: int = 0) -> dict:
    return {"config": name, **Sim(name, kind, seed=seed).run()}


def replay(rows: list[dict], name: str, days: float = 54.0, spares: int | None = None, seed: int = 0) -> dict:
    """Llama 3's 419 interruptions over 54 days on 16,384 GPUs (the same mix at the same rate per GPU
    for another size): each costs its kind's simulated recovery (and the
    step in flight); with no warm spare left, or the supervisor's node, a restart from the last
    checkpoint (the plan's Young/Daly interval). ETTR = productive time / wall time."""
    plan, rng = plan_of(name), random.Random(seed)
    br, step_s = plan.blast_radius, plan.step.to_json()["wall_s"]
    every, ckpt_s = br["checkpoint_interval_s"], br["checkpoint_seconds"]
    by_kind = {r["scenario"]: r for r in rows if r["config"] == name}
    T = days * 86400.0
    if spares is None:  # warm spare copies sized to the repair pipeline: failures per repair time, plus one
        spares = math.ceil(CONSTANTS["repair_s"] / (br["job_mtbf_hours"] * 3600.0)) + 1
    mix = [k for _, n, k in LLAMA3_TABLE5 for _ in range(n)]  # 419 on 16,384 GPUs: scaled to this size
    kinds = [rng.choice(mix) for _ in range(round(len(mix) * plan.world_size / 16384))] if plan.world_size != 16384 \
        else mix
    times = sorted(rng.uniform(0, T) for _ in kinds)
    rng.shuffle(kinds)
    back: list[float] = []  # when the failed nodes return as spares
    pool, lost, restarts = spares, 0.0, 0
    restart = CONSTANTS["node_down_s"] + CONSTANTS["restart_load_s"] + every / 2
    for t, kind in zip(times, kinds):
        pool += sum(1 for b in back if b <= t)
        back = [b for b in back if b > t]
        supervisor_hit = rng.random() < 1.0 / plan.spec.cluster.nodes
        if supervisor_hit or pool == 0:
            restarts += 1
            lost += restart + (CONSTANTS["requeue_s"] if supervisor_hit else 0.0)
            continue
        r = by_kind[kind]
        lost += (r["recovery_s"] or 0.0) + step_s / 2  # the recovery, and half a step in flight redone
        pool -= 1
        back.append(t + CONSTANTS["repair_s"])
    overhead = ckpt_s / every if every else 0.0  # blocking checkpoint writes
    ettr = (T - lost) / T * (1 - overhead)
    from orchestrator.plan.goodput import goodput

    predicted = goodput(plan)["predicted_ettr"]
    return {"replay": "llama3_54_days", "config": name, "interruptions": len(kinds), "days": days,
            "warm_spare_copies": spares, "spare_gpu_share": round(spares / (plan.layout.dp_replicate + spares), 4),
            "restarts": restarts, "lost_hours": round(lost / 3600, 2),
            "checkpoint_interval_s": round(every, 1), "checkpoint_overhead": round(overhead, 5),
            "ettr": round(ettr, 4), "plan_predicted_ettr": round(predicted, 4),
            "plan_minus_sim_points": round(100 * (predicted - ettr), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="16k-128,100k-128,16k-8,100k-8")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    CONSTANTS["store_ops_s"] = measured_store_ops_s() or CONSTANTS["store_ops_s"]
    rows = []
    for n in a.configs.split(","):
        for k in a.scenarios.split(","):
            rows.append(scenario(n, k))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: a 100k-rank scenario takes minutes
    replays = [replay(rows, n) for n in a.configs.split(",") if set(a.scenarios.split(",")) >= set(SCENARIOS)]
    if a.json:
        print(json.dumps({"constants": CONSTANTS, "scenarios": rows, "replays": replays}, indent=1))
        return
    print("constants (stated; store_ops_s measured when torch is there):",
          ", ".join(f"{k}={v:g}" for k, v in CONSTANTS.items()))
    cols = ["config", "scenario", "ranks", "copies", "detected_s", "recovered", "recovery_s", "steps_lost",
            "healthy_evicted", "commit_p50_s", "commit_p99_s", "step_s"]
    print(" ".join(f"{c:>15s}" for c in cols))
    for r in rows:
        print(" ".join(f"{_fmt(r.get(c)):>15s}" for c in cols))
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

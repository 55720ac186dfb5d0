"""The supervisor's lease (launch/lease.py) on a virtual clock, and what a fenced supervisor does:
the lease expires only when its holder stops renewing it, a standby takes it over with the next
generation, a holder that comes back is fenced (it writes nothing and steps down), two standbys
racing for one expired lease never both win, and a released lease is not taken over. Fast: files in
a temporary directory, no SLURM (tests/test_slurm.py kills the supervisor's node for real)."""
import threading

from conftest import plan_of
from orchestrator import rundir
from orchestrator.launch.batch import watch
from orchestrator.launch.lease import Lease, Renewer
from orchestrator.launch.status import read_status, write_status
from orchestrator.launch.supervisor import Outcome, Workers, supervise


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_lease_expires_only_when_its_holder_stops_renewing(tmp_path):
    clock = Clock()
    active = Lease(tmp_path, 10.0, holder="sup", clock=clock)
    standby = Lease(tmp_path, 10.0, holder="standby", clock=clock)
    assert not standby.expired()  # never held: nothing to take over
    assert active.acquire() and active.generation == 1
    for _ in range(20):  # renewed every 2 s for 40 s: never expired
        clock.now += 2.0
        assert active.renew() and not standby.expired()
    clock.now += 10.0
    assert not standby.expired()  # exactly the timeout: not yet
    clock.now += 0.5
    assert standby.expired() and standby.age_s() == 10.5


def test_a_standby_takes_over_and_the_returning_holder_is_fenced(tmp_path):
    clock = Clock()
    active = Lease(tmp_path, 10.0, holder="sup", host="node1", clock=clock)
    standby = Lease(tmp_path, 10.0, holder="standby", host="node2", clock=clock)
    active.acquire()
    clock.now += 11.0
    assert standby.expired() and standby.acquire(after=standby.claimed())
    assert standby.generation == 2 and not standby.expired()
    held = standby.read()
    assert (held["holder"], held["host"], held["generation"]) == ("standby", "node2", 2)
    clock.now += 1.0
    assert active.fenced() and not active.renew()  # the old holder comes back: it steps down
    assert standby.read()["holder"] == "standby" and standby.read()["renewed"] == held["renewed"]  # nothing written
    active.release()
    assert not standby.read().get("released")  # a fenced holder cannot release its successor's lease
    assert standby.renew() and not standby.fenced()


def test_two_standbys_racing_for_one_expired_lease_never_both_win(tmp_path):
    clock = Clock()
    Lease(tmp_path, 5.0, holder="sup", clock=clock).acquire()
    clock.now += 6.0
    a, b = (Lease(tmp_path, 5.0, holder=h, clock=clock) for h in "ab")
    seen_a, seen_b = a.claimed(), b.claimed()  # both saw generation 1 expire
    assert a.acquire(after=seen_a) and not b.acquire(after=seen_b)
    assert b.generation == 0 and not b.expired()  # b watches the new holder


def test_a_released_lease_is_not_taken_over(tmp_path):
    clock = Clock()
    active = Lease(tmp_path, 5.0, holder="sup", clock=clock)
    active.acquire()
    active.release()
    clock.now += 100.0
    standby = Lease(tmp_path, 5.0, holder="standby", clock=clock)
    assert not standby.expired()
    assert watch(standby, tmp_path, 1.0, sleep=lambda s: None) is None  # the run ended under its holder
    fresh = Lease(tmp_path, 5.0, holder="next job", clock=clock)
    assert fresh.acquire() and fresh.generation == 2 and not fresh.read().get("released")


def test_the_renewer_steps_down_when_fenced(tmp_path):
    active = Lease(tmp_path, 1.0, holder="sup")
    active.acquire()
    fenced = threading.Event()
    renewer = Renewer(active, 0.02, fenced.set)
    assert Lease(tmp_path, 1.0, holder="standby").acquire(after=1)  # claimed by force: the holder is fenced
    assert fenced.wait(timeout=30.0)  # its next renewal finds the claim (bounded wait on the event itself)
    renewer.stop()
    assert Lease(tmp_path, 1.0).read()["holder"] == "standby"


class _FencedWhileWaiting(Workers):
    """The step ends because a standby took the lease (SrunWorkers.fence stops it)."""

    def nodes(self):
        return ["n1", "n2"]

    def start(self, attempt, plan_dir, nodes, env, policy=None):
        return list(nodes)

    def wait(self):
        self.fenced = True
        return Outcome(False, [], "the training step exited with status -9")

    def stop(self):
        pass


def test_a_fenced_supervisor_decides_and_writes_nothing(tmp_path):
    """supervise returns EXIT_FENCED as soon as its workers are fenced: no failover decided, no
    status written over its successor's (the run's state stays what it was)."""
    plan = plan_of("hardware=cpu", "model=tiny", "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=1")
    write_status(tmp_path, state="running", message="the successor's")
    code = supervise(plan, tmp_path, _FencedWhileWaiting(), say=lambda *a, **k: None)
    assert code == rundir.EXIT_FENCED
    assert read_status(tmp_path)["state"] == "running" and not (tmp_path / rundir.FAILOVER_JSON).exists()


class _Step:
    """A standby's srun step: running until its node dies."""

    def __init__(self):
        self.code = None

    def poll(self):
        return self.code


def test_a_standby_whose_node_dies_is_replaced_on_another_node(tmp_path):
    """The supervisor keeps a standby (lease.Standby, looked after at each renewal by the real
    Renewer): on the last node first; when its step ends while the run goes on (its node died) a
    new one starts on the next node that is neither the supervisor's, lost, nor one tried before;
    none once the run is over."""
    from orchestrator.launch.lease import Standby

    active = Lease(tmp_path, 1.0, holder="sup", host="n1")
    active.acquire()
    started, steps, lost, going = threading.Event(), {}, set(), [True]

    def start(node):
        steps[node] = _Step()
        started.set()
        return steps[node]
    standby = Standby(["n1", "n2", "n3", "n4"], "n1", start, gone=lambda: lost, going=lambda: going[0])
    assert standby.check() == "n4" and standby.check() is None  # one runs: nothing more
    lost.add("n3")  # a node the supervisor lost: never a standby's
    renewer = Renewer(active, 0.02, lambda: None, on_renewed=standby.check)
    started.clear()
    steps["n4"].code = -9  # the standby's node died: its srun step ended
    assert started.wait(timeout=30.0)  # the next renewal started another (bounded wait on the start itself)
    renewer.stop()
    assert standby.tried == ["n4", "n2"] and standby.node == "n2"
    steps["n2"].code = -9
    assert standby.check() is None and standby.tried == ["n4", "n2"]  # n1 is the supervisor's, n3 lost: none left
    going[0] = False
    lost.clear()
    assert standby.check() is None  # the run is over: none started


def test_a_takeover_counts_toward_the_failover_budget_and_is_refused_past_it(tmp_path, monkeypatch):
    """A standby's takeover restarts the ranks: its supervisor_takeover event counts toward
    failover.max_failovers_per_hour like a restart (failover.why_stop), and a takeover past that
    budget stops the run (batch.take_over: recorded, the status failed, nothing resumed)."""
    import time

    from orchestrator.launch import batch, failover, runs, srun
    from orchestrator.rundir import events

    plan = plan_of("hardware=cpu", "model=tiny", "launcher=slurm", "cluster.nodes=3", "hardware.gpus_per_node=1",
                   "failover.max_failovers_per_hour=2")
    now = time.time()
    takeovers = [{"mode": "supervisor_takeover", "time": now - 600}, {"mode": "supervisor_takeover", "time": now - 60}]
    assert failover.why_stop(plan, takeovers[:1], 3, now=now) is None
    assert "max_failovers_per_hour=2" in failover.why_stop(plan, takeovers, 3, now=now)[0]
    assert "max_failovers_per_hour=2" in failover.why_stop(plan, [{"mode": "restart", "time": now - 5}]
                                                           + takeovers[1:], 3, now=now)[0]
    monkeypatch.setattr(runs, "load_plan", lambda run_dir, latest=True: plan)
    monkeypatch.setattr(srun, "resume", lambda *a, **k: 0)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    old = Lease(tmp_path, 1.0, holder="n1:7", host="n1")
    assert old.acquire()
    held = old.read()  # what the standby read when the lease expired
    lease = Lease(tmp_path, 1.0, holder="n3:9", host="n3")
    assert lease.acquire(after=old.generation)
    for e in takeovers[:1]:
        events.record(tmp_path, e)
    assert batch.take_over(plan.spec, tmp_path, lease, held) == 0  # one in the hour: within the budget
    events.record(tmp_path, takeovers[1])
    monkeypatch.setattr(srun, "resume", lambda *a, **k: (_ for _ in ()).throw(AssertionError("resumed")))
    assert batch.take_over(plan.spec, tmp_path, lease, held) == rundir.EXIT_FAILED
    refused = [e for e in events.read_events(tmp_path) if e["mode"] == "supervisor_takeover_refused"]
    assert len(refused) == 1 and "max_failovers_per_hour=2" in refused[0]["reason"]
    assert read_status(tmp_path)["state"] == "failed"

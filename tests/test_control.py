"""The control plane lets no one else in (issue #28) and holds at scale (issue #24): the real
Coordinator and ControlServer over loopback sockets, copy leaders emulated with the
runtime's own client (train/wire.py). Torch-free; behaviour, not timings."""
import os
import secrets
import socket
import stat
import sys
import threading
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from control_fuzz import DOS, fuzz  # noqa: E402

from orchestrator.launch.control import ControlServer, Coordinator, Decision  # noqa: E402
from orchestrator.train import wire  # noqa: E402


class Job:
    """A coordinator of `copies` on a port; `decide` keeps the survivors and admits every joiner."""

    def __init__(self, copies, quorum_s=5.0, commit_timeout_s=60.0):
        self.key, self.decisions = secrets.token_bytes(32), []
        self.coord = Coordinator(list(copies), "plan0", self.decide, quorum_s=quorum_s,
                                 commit_timeout_s=commit_timeout_s)
        self.server = ControlServer(self.coord, self.key)
        self.addr = self.server.address()

    def decide(self, alive, dead, joiners, step):
        self.decisions.append((alive, dead, joiners, step))
        return Decision(True, f"plan{len(self.decisions)}", list(alive) + list(joiners))

    def leader(self):
        return wire.Client(self.addr, self.key)

    def raw(self, data: bytes):
        s = socket.create_connection(("127.0.0.1", self.server.port), timeout=5)
        s.sendall(data)
        return s

    def settle(self, dropped: int):
        """Wait (bounded) for the server to have counted `dropped` lines."""
        deadline = time.monotonic() + 10
        while self.coord.counts()["dropped_total"] < dropped and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.coord.counts()

    def until(self, done, what: str):
        """Wait (bounded) until the server itself says it got there (its own counters, never a sleep)."""
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done(), f"the server never {what}"


@pytest.fixture
def job():
    j = Job([0, 1])
    yield j
    j.server.close()


def commit(client, copy, step, gen=0, loss=1.0, timeout=30):
    return client.request({"op": "commit", "copy": copy, "gen": gen, "step": step, "sums": [loss, 1.0, 0.0]},
                          timeout)


def both_commit(job, a, b, step):
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault(1, commit(b, 1, step, loss=3.0)))
    t.start()
    out[0] = commit(a, 0, step, loss=1.0)
    t.join(30)
    return out


def test_the_issue_28_join_and_every_kind_of_bad_line_are_dropped_counted_and_change_nothing(job):
    a, b = job.leader(), job.leader()
    assert both_commit(job, a, b, 0)[0] == {"op": "commit", "step": 0, "loss": 2.0, "stop": False}
    sniffed = wire.encode(job.key, {"op": "commit", "copy": 0, "gen": 0, "step": 1, "sums": [0.0, 1.0, 0.0]},
                          a.nonce, 2)  # a's next line, seen on the wire
    forged = wire.encode(b"not the key", {"op": "failed", "copy": 1, "gen": 0, "step": 1}, a.nonce, 2)
    bad = [DOS, forged, sniffed, b"{not json\n", b'{"op": "commit", "copy": 0, "gen": 0, "step": 1}\n']
    socks = [job.raw(line) for line in bad]
    counts = job.settle(len(bad))
    assert counts["dropped"] == {"unsigned": 3, "bad_mac": 1, "replayed": 1}
    # a's own line sent twice on its own connection: the second is a replay
    a.sock.sendall(sniffed + sniffed)
    a.seq = 2
    counts = job.settle(len(bad) + 1)
    assert counts["dropped"]["replayed"] == 2
    assert commit(b, 1, 1, loss=3.0)["op"] == "commit"  # the step completes with a's (first) line
    assert wire.decode(job.key, a.rfile.readline())[2]["step"] == 1
    counts = job.coord.counts()
    assert job.coord.current.gen == 0 and job.coord.current.copies == [0, 1] and not job.decisions
    assert counts["commits"] == 2 and counts["generation"] == 0
    for s in socks:
        s.close()


def test_signed_but_out_of_protocol_messages_are_dropped(job):
    a, b, insider = job.leader(), job.leader(), job.leader()
    for body in [{"op": "explode", "copy": 0, "gen": 0}, {"op": "join", "copy": 7, "gen": 0, "now": True},
                 {"op": "commit", "copy": 5, "gen": 0, "step": 0, "sums": [0, 1, 0]},
                 {"op": "commit", "copy": 0, "gen": 3, "step": 0, "sums": [0, 1, 0]},
                 {"op": "commit", "copy": 0, "gen": 0, "step": 0, "sums": [0, "1"]}]:
        insider.send(body)
    counts = job.settle(5)
    assert counts["dropped"] == {"unknown_op": 1, "join_not_launched": 1, "not_in_generation": 1,
                                 "future_generation": 1, "malformed": 1}
    both_commit(job, a, b, 0)
    a.send({"op": "commit", "copy": 0, "gen": 0, "step": 5, "sums": [0, 1, 0]})  # not the step being committed
    assert job.settle(6)["dropped"]["wrong_step"] == 1
    assert not job.decisions and job.coord.current.gen == 0


def test_a_closed_leader_connection_is_its_copy_lost_and_a_bye_is_not(job):
    a, b = job.leader(), job.leader()
    both_commit(job, a, b, 0)
    b.close()  # copy 1's leader gone without a word: the others re-form without it
    answer = commit(a, 0, 1)
    assert answer["op"] == "reform" and answer["copies"] == [0] and answer["step"] == 1
    assert job.decisions == [([0], [1], [], 1)]
    lines = job.server.lines
    a.send({"op": "bye", "copy": 0, "gen": 1})
    job.until(lambda: job.server.lines > lines and 0 in job.coord.finished, "read the bye")
    closes = job.server.closes
    a.close()
    job.until(lambda: job.server.closes > closes, "saw the connection close")
    assert len(job.decisions) == 1 and job.coord.changing is None  # a finished copy closing is not a loss


def test_a_silent_copy_is_dropped_after_the_commit_deadline_and_the_quorum_window():
    job = Job([0, 1, 2], quorum_s=0.3, commit_timeout_s=0.3)
    try:
        a, b, _hung = job.leader(), job.leader(), job.leader()
        import threading

        out = {}
        t = threading.Thread(target=lambda: out.setdefault("b", commit(b, 1, 0)))
        t.start()
        out["a"] = commit(a, 0, 0)  # copy 2 never asks: nobody waits without a deadline
        t.join(30)
        assert out["a"]["op"] == out["b"]["op"] == "reform" and out["a"]["copies"] == [0, 1]
        assert job.decisions == [([0, 1], [2], [], 0)]
    finally:
        job.server.close()


def test_a_launched_spare_joins_once_and_a_never_launched_copy_cannot_loop_the_job(job):
    a, b = job.leader(), job.leader()
    job.coord.expect(2)
    spare = job.leader()
    import threading

    got = {}
    t = threading.Thread(target=lambda: got.setdefault("spare", spare.request({"op": "join", "copy": 2, "gen": -1,
                                                                                "now": True}, 30)))
    t.start()
    job.until(lambda: 2 in job.coord.joiners, "took the spare's join")
    answers = both_commit(job, a, b, 0)
    t.join(30)
    assert answers[0]["op"] == "reform" and got["spare"]["copies"] == [0, 1, 2] and len(job.decisions) == 1
    closes, dropped = job.server.closes, job.coord.counts()["dropped_total"]
    job.raw(DOS).close()  # a copy that was never launched asks to join, now, and goes
    job.until(lambda: job.server.closes > closes and job.coord.counts()["dropped_total"] > dropped,
              "read the stranger's join and saw it go")
    assert len(job.decisions) == 1 and job.coord.changing is None


def test_fuzz_of_the_protocol_with_emulated_leaders():
    r = fuzz(leaders=8, steps=30, seed=1)
    assert r["commits_in_order"] and r["losses_right"] and r["commits"] == 30
    assert r["dropped_total"] == r["bad_lines_sent"] >= 40 and r["generation"] == 0 and r["decisions"] == 0


def test_the_secret_is_owner_only(tmp_path):
    path = wire.make_secret(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(wire.read_secret(path)) == 64


def test_runs_are_owner_only_and_another_users_run_is_refused(tmp_path, monkeypatch):
    from orchestrator.launch import privacy

    old = os.umask(0o022)
    try:
        privacy.owner_only(tmp_path / "run", group_readable=False)
        (tmp_path / "run" / "plan.json").write_text("{}")
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "plan.json").st_mode) == 0o600
        privacy.owner_only(tmp_path / "shared", group_readable=True)
        assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o750
    finally:
        os.umask(old)
    assert privacy.other_owner(tmp_path / "run", None, allow=False) == []
    if os.getuid() == 0:  # give it to another user for real
        os.chown(tmp_path / "run", 4321, 4321)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    (problem,) = privacy.other_owner(tmp_path / "run", None, allow=False)
    assert problem.key == "launcher.allow_other_owner" and str(tmp_path / "run") in problem.message
    assert privacy.other_owner(tmp_path / "run", None, allow=True) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a directory to another user")
def test_the_cli_refuses_to_write_into_another_users_run(tmp_path):
    from conftest import run_cli

    (tmp_path / "run").mkdir()
    os.chown(tmp_path / "run", 4321, 4321)
    r = run_cli(["hardware=cpu", "model=tiny", "figures=false"], tmp_path)
    assert r.returncode == 2 and "launcher.allow_other_owner" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "plan.json").exists()
    r = run_cli(["hardware=cpu", "model=tiny", "figures=false", "launcher.allow_other_owner=true"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_commits_climb_a_tree_of_leaders_and_an_aggregator_lost_strands_nobody(tmp_path, monkeypatch):
    """80 copies (fan-in 16: the coordinator hears 16 sums a step) with the leaders' own code
    (Replicas' tree path, train/tree.py) over loopback: each step every leader gets the totals over
    all 80; then an aggregator with 16 copies under it dies with their commits in its hands: its
    children re-home to the coordinator, which decides without it, and every survivor is told."""
    from orchestrator.train.replicas import Replicas

    R = 80
    monkeypatch.setenv(wire.KEY_ENV, str(wire.make_secret(tmp_path)))
    decisions = []

    def decide(alive, dead, joiners, step):
        decisions.append((alive, dead, step))
        return Decision(True, "plan", list(alive))

    coord = Coordinator(list(range(R)), "plan", decide, quorum_s=3.0, commit_timeout_s=20.0)
    server = ControlServer(coord, wire.env_secret())
    reps = [Replicas(None, server.address(), c, 0, 1, timeout_s=10.0, copies=list(range(R))) for c in range(R)]
    try:
        for r in reps:
            r.tree_for(0, list(range(R)))
        assert coord.fan_in == 16 and all(r.agg is not None for r in reps)

        def step(leaders, k, meanwhile=None):
            out = {}
            threads = [threading.Thread(target=lambda r=r: out.__setitem__(r.copy, r._up_the_tree(
                {"op": "commit", "copy": r.copy, "gen": r.gen, "step": k, "sums": [float(r.copy), 1.0, 0.0]}, 30.0)))
                for r in leaders]
            for t in threads:
                t.start()
            if meanwhile is not None:
                meanwhile()
            for t in threads:
                t.join(60)
            return out

        for k in range(3):
            out = step(reps, k)
            assert len(out) == R and all(a == {"op": "commit", "step": k, "loss": (R - 1) / 2, "stop": False}
                                         for a in out.values()), out
        assert coord.commits == 3 and len(reps[0].agg.kids) == 16  # copy 0 sums copies 16..31's
        def die():  # copy 0 dies holding its children's commits: its aggregator and its connection go
            deadline = time.monotonic() + 30
            while reps[0].agg.n < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reps[0].agg.n == 16 and not reps[0].agg.sent  # 16 children in, its own commit missing
            reps[0].server.close()
            reps[0].client.close()
        out = step(reps[1:], 3, meanwhile=die)
        assert decisions == [(list(range(1, R)), [0], 3)]
        assert len(out) == R - 1 and all(a["op"] == "reform" and a["copies"] == list(range(1, R))
                                         for a in out.values()), out
        assert sum(coord.dropped.values()) == 0, coord.dropped
    finally:
        for r in reps[1:]:
            r.finish()
        server.close()


def test_a_copy_known_lost_aborts_the_generation_at_once_and_the_decision_releases_it():
    """#36: the supervisor's word (lost) wakes the survivors out of the generation's cross-copy
    collectives at once (abort(gen, dead)), before any survivor has reported; the decision then
    releases the old generation's watchers (abort(gen, [])) and its history says it was aborted."""
    calls = []
    coord = Coordinator([0, 1, 2], "plan0", lambda alive, dead, joiners, step: Decision(True, "plan1", alive),
                        quorum_s=5.0, abort=lambda gen, dead: calls.append((gen, dead)))
    answers = {}
    coord.handle({"op": "commit", "copy": 0, "gen": 0, "step": 0, "sums": [1.0, 1.0, 0.0]},
                 lambda a: answers.setdefault(0, a))  # copy 0 got through; copy 1 waits on copy 2
    coord.lost([2])
    assert calls == [(0, [2])] and coord.current.gen == 0  # told now, before copy 1 has reported
    coord.handle({"op": "failed", "copy": 1, "gen": 0, "step": 0, "sums": [0.0, 0.0, 0.0]},
                 lambda a: answers.setdefault(1, a))
    assert answers[0] == answers[1] and answers[0]["op"] == "reform" and answers[0]["copies"] == [0, 1]
    assert calls == [(0, [2]), (0, [])] and coord.history[-1]["aborted"]["dead"] == [2]


def test_a_cut_nobody_sees_is_aborted_past_the_bound_and_the_copy_the_others_cannot_reach_is_lost():
    """#36: a copy cut off on the data path while its leader's connection is up. Every rank beats
    `wait` (launch/progress.in_collective reads the real beats); the coordinator aborts only when
    every rank is in the step's collective past the bound with no commit of the step in, never on a
    straggler (a rank not there yet) or a collective whose commit round is merely slow; the reports
    then name whom each copy could not reach, and the copy most could not reach is declared lost."""
    from orchestrator.launch.control import MAX_CUT_ABORTS
    from orchestrator.launch.progress import Beat, in_collective

    def beats(*phases, now=100.0, last=11.0):  # one rank per copy; the last entered `last` s before `now`
        return {i: Beat(i, 3, p == "end", now - last - (len(phases) - 1 - i), i, f"n{i}", i, p == "wait")
                for i, p in enumerate(phases)}

    assert in_collective(beats("wait", "wait", "begin"), 100.0) is None  # a straggler: the others wait on it
    assert in_collective(beats("wait", "wait", "wait"), 100.0) == (3, 11.0)
    clock, calls, decided = [0.0], [], []

    def coordinator(copies):
        return Coordinator(copies, "plan0", lambda alive, dead, joiners, step: decided.append((alive, dead))
                           or Decision(True, "plan1", alive), quorum_s=5.0, clock=lambda: clock[0],
                           abort=lambda gen, dead: calls.append((gen, dead)), collective_s=10.0)

    coord = coordinator([0, 1, 2])
    assert not coord.in_collective(*in_collective(beats("wait", "wait", "wait", last=5.0), 100.0))  # within
    coord.handle({"op": "commit", "copy": 0, "gen": 0, "step": 3, "sums": [1.0, 1.0, 0.0]}, lambda a: None)
    assert not coord.in_collective(3, 50.0) and calls == []  # the collective completed: its commit round is slow
    coord = coordinator([0, 1, 2])
    assert coord.in_collective(3, 11.0) and calls == [(0, [])] and coord.changing is not None  # aborted
    answers = {}
    for copy, reached, unreached in ((0, [1], [2]), (1, [0], [2]), (2, [], [0, 1])):  # the cut copy's leader
        coord.handle({"op": "failed", "copy": copy, "gen": 0, "step": 3, "sums": [0.0, 0.0, 0.0],  # still reports
                      "reached": reached, "unreached": unreached}, lambda a, copy=copy: answers.setdefault(copy, a))
    assert decided == [([0, 1], [2])] and answers[0]["op"] == "reform" and answers[0]["copies"] == [0, 1]
    assert answers[2]["op"] == "exit" and coord.history[-1]["aborted"]["why"] == "partition"
    assert coord.history[-1]["aborted"]["cut"] == [2]
    two = coordinator([0, 1])  # two copies cut from each other: who is cut cannot be known; both go on
    assert two.in_collective(0, 11.0)
    for copy in (0, 1):
        two.handle({"op": "failed", "copy": copy, "gen": 0, "step": 0, "sums": [0.0, 0.0, 0.0],
                    "unreached": [1 - copy]}, lambda a: None)
    assert decided[-1] == ([0, 1], [])
    for gen in range(1, MAX_CUT_ABORTS):  # still cut, no step committed: at most MAX_CUT_ABORTS aborts in a row
        assert two.in_collective(0, 11.0)
        for copy in (0, 1):
            two.handle({"op": "failed", "copy": copy, "gen": gen, "step": 0, "sums": [0.0, 0.0, 0.0]}, lambda a: None)
    assert not two.in_collective(0, 11.0)  # then the collective timeout is the last resort again

"""The failover control plane at 2,048 ranks (256 copies of 8, a commit tree of fan-in 16): the real
supervisor loop and SLURM wait loop (sinfo/scontrol shims replaying node states), the real
coordinator, commit tree and in-place decision, leaders emulated on a virtual clock
(benchmarks/failover_sim.py). Every failure kind recovers in place (an aggregator's death
included), no healthy copy is dismissed, nobody is left waiting, every wait ends within the
timeouts, and no step is lost; a loss that is known (a crash, a node down, a stalled copy) aborts
the survivors' collectives instead of waiting for their timeout, and so does a cut of the data path
alone (every copy in the collective past the plan's bound); the straggler is named; the
supervisor's node lost is recovered by its standby taking over through the real lease. The
replay's arithmetic is checked on given costs (an unrecovered kind is charged a restart, a failure
with no spare left shrinks the copies). Behaviour only: the timings are the benchmark's to print."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import failover_sim  # noqa: E402

IN_PLACE = ["crash", "node", "hang", "straggler", "two", "flap", "drain", "partition", "cut", "aggregator"]


@pytest.fixture(scope="module")
def rows():
    return {k: failover_sim.scenario("2k-8", k) for k in failover_sim.SCENARIOS}


@pytest.mark.parametrize("kind", IN_PLACE)
def test_every_failure_kind_recovers_in_place_at_2048_ranks(rows, kind):
    r = rows[kind]
    assert r["ranks"] == 2048 and r["copies"] == 256 and r["fan_in"] == 16
    assert r["recovered"] and r["supervisor_exit"] == 0, r
    assert r["healthy_evicted"] == 0 and r["left_waiting"] == 0 and r["steps_lost"] == 0, r
    assert r["dropped"] == 0, r  # the emulated leaders never sent anything out of protocol
    assert r["steps_done"] == r["steps"] >= (20 if kind == "flap" else 12)  # every step of the run committed
    if kind == "straggler":  # slow, not failed: nobody dropped, no new generation, and the slow copy named
        assert r["generations"] == 0 and r["detected_s"] is None
        assert r["stragglers_named"] == [r["copies"] - 1], r  # Sim.inject slows the last copy
    else:
        assert r["generations"] >= 1 and r["detected_s"] is not None
        # the failure is decided within the ladder's waits (a deadline, not a speed), and only then recovered
        assert r["detected_s"] <= r["wait_bound_s"] and r["detected_s"] <= r["recovery_s"], r
        p = r["phases"]  # where the time went, in the order it goes, ending at the recovery
        assert p["detected"] <= p["decided"] <= p["told"] <= p["started"] <= p["committed"] == r["recovery_s"], p
        # the step in flight is finished from the survivors' gradients: the lost copies' micro-batches (M / R
        # each: 1,024 of one sample over 256 copies) spread over the 256 copies the spares keep, one a copy
        plan = failover_sim.plan_of("2k-8")
        per_copy = plan.spec.training.global_batch // plan.spec.training.micro_batch // r["copies"]
        lost = 2 if kind == "two" else 1
        assert r["redo"] == "kept" and p["recomputed_mb"] == -(-lost * per_copy // r["copies"]) == 1, r
    assert r["max_wait_s"] <= r["wait_bound_s"], r  # no wait without end: no leader waited past the ladder
    if kind in ("node", "hang", "two", "flap", "partition", "cut"):  # known lost (its leader's connection unanswered,
        assert r["survivors_released"] == "abort", r  # its beats stalled, every rank in the collective past
        assert r["collectives_timed_out"] == 0, r  # its bound): aborted; no collective ran into its timeout
    # a cut on the data path alone: the copy the others cannot reach is the one declared lost, nobody else
    assert r["declared_cut"] == ([r["copies"] - 1] if kind == "cut" else []), r
    # (how long recovery takes is the benchmark's to print: failover_sim.py, recovery_s beside wait_bound_s)


def test_the_supervisors_node_lost_is_recovered_by_its_standby_taking_over(rows):
    """The supervisor scenario: the real lease and the standby's real watch on the virtual clock. The
    standby takes over (generation 2) no sooner than the lease lets it and within a renewal period of
    its expiry, the old holder coming back is fenced, and the replay charges a supervisor's node the
    plan's one definition (goodput.supervisor_lost_s) with that detection, not a requeue."""
    from orchestrator.plan import goodput
    from orchestrator.plan.timeouts import lease_period_s, lease_s

    r, plan = rows["supervisor"], failover_sim.plan_of("2k-8")
    timeout = lease_s(plan.spec.failover, plan.spec.launcher.poll_s)
    assert r["recovered"] and r["recovered_by"] == "takeover" and r["generation"] == 2 and r["old_fenced"], r
    assert timeout - lease_period_s(timeout) <= r["detected_s"] <= timeout + lease_period_s(timeout), r
    g = goodput.goodput(plan)
    replay = failover_sim.replay(list(rows.values()), "2k-8")
    assert replay["supervisor_lost_s"] == pytest.approx(r["detected_s"] + g["restart_base_s"], abs=0.1)
    assert g["supervisor_lost_s"] == pytest.approx(g["takeover_s"] + g["restart_base_s"])
    assert g["takeover_s"] == timeout


def test_the_simulation_waits_by_the_plans_ladder():
    plan = failover_sim.plan_of("2k-8")
    fo, t = plan.spec.failover, plan.blast_radius["timeouts"]
    assert fo.timeout_s == t["collective_s"] and fo.quorum_s == t["quorum_s"]
    assert failover_sim.wait_bound_s("2k-8") == pytest.approx(
        t["collective_s"] + t["quorum_s"] + t["settle_s"] + failover_sim.CONSTANTS["node_down_s"]
        + plan.spec.launcher.poll_s)


def test_the_replay_charges_given_costs():
    """tally on given costs: each in-place failure its kind's delay; a kind that did not recover a
    restart (never nothing); the supervisor's node its own cost (a takeover and a restart); no spare left: the
    same delay and one copy short (1/copies of the time) until the first node back."""
    ev = [(0.0, "crash", False), (50.0, "crash", False), (200.0, "node", False), (300.0, "hang", False),
          (400.0, "node", True)]
    got = failover_sim.tally(ev, {"crash": 10.0, "node": 30.0, "hang": None}, spares=1, restart_s=1000.0,
                             supervisor_s=1500.0, repair_s=100.0, copies=4)
    # t=0 takes the spare (its node back at 100); t=50 finds none: shrinks until the node back at 100
    # rejoins (50 s x 1/4); t=50's node back at 150 refills the pool; t=200 takes the spare again; the hang
    # did not recover: a restart; t=400: the supervisor's node
    assert got["lost_s"] == pytest.approx(10 + (10 + 50 / 4) + 30 + 1000 + 1500)
    assert (got["restarts"], got["no_spare"], got["unrecovered"]) == (2, 1, 1)
    # no spare at all: every in-place failure shrinks; a node back rejoins (it does not refill the pool)
    none = failover_sim.tally([(0.0, "crash", False), (10.0, "crash", False), (500.0, "crash", False)],
                              {"crash": 1.0}, 0, 1000.0, 1500.0, 100.0, copies=2, end_s=1000.0)
    assert none["no_spare"] == 3 and none["short_copy_hours"] == pytest.approx((100 + 100 + 100) / 3600)
    assert none["lost_s"] == pytest.approx(3 * 1.0 + 300 / 2)
    plenty = failover_sim.tally(ev[:4], {"crash": 10.0, "node": 30.0, "hang": 5.0}, 10, 1000.0, 1500.0, 100.0, 4)
    assert plenty["lost_s"] == pytest.approx(55.0) and plenty["restarts"] == plenty["no_spare"] == 0


def test_an_unrecovered_scenario_is_charged_a_restart(rows):
    base = failover_sim.replay(list(rows.values()), "2k-8")
    broken = [dict(r, recovered=False) if r["scenario"] == "crash" else r for r in rows.values()]
    worse = failover_sim.replay(broken, "2k-8")
    assert base["interruptions"] == round(419 * 2048 / 16384) and base["unrecovered"] == 0
    assert worse["unrecovered"] > 0 and worse["restarts"] == base["restarts"] + worse["unrecovered"]
    assert worse["lost_hours"] > base["lost_hours"] + worse["unrecovered"] * (worse["restart_s"] - 60) / 3600


def test_the_plan_prices_each_failure_kind_as_the_simulation_measures_it(rows):
    """What the plan says a failure of each kind costs in place (plan/goodput.py: the wait until it is
    known, the rebuild, the step redone) against the delay the simulation measures for it at 2,048
    ranks: a plan that ignored failures, or a simulation that lost the abort, would be far off."""
    from orchestrator.plan import goodput

    g = goodput.goodput(failover_sim.plan_of("2k-8"))
    for kind in ("crash", "node", "hang", "partition", "drain"):
        # both on the simulation's virtual clock with the plan's constants (no wall time is read:
        # failover_sim.main alone replaces the store's rate with a measured one): a model check
        plan_s, sim_s = g["by_kind"][kind]["in_place_s"], rows[kind]["delay_s"]
        assert abs(plan_s - sim_s) <= max(0.25 * sim_s, 3.0), (kind, plan_s, sim_s)

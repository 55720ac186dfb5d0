"""The failover timeout ladder (plan/timeouts.py): derived in order from the plan's step and save,
refused when what was set breaks the order, printed in plan.md, and the one the SLURM supervisor
waits by; and the goodput prediction that reads it (plan/goodput.py)."""
import sys

import pytest

from conftest import ROOT, plan_of, run_cli

TINY = ["hardware=cpu", "model=tiny", "figures=false"]


def _ordered(t):
    return (t["settle_s"] < t["quorum_s"] < t["collective_s"] and t["hang_deadline_s"] < t["collective_s"]
            and t["stall_s"] <= t["hang_deadline_s"])


@pytest.mark.parametrize("overrides", [TINY, ["recipe=llama3_405b"]])
def test_the_derived_ladder_is_ordered_and_the_runtime_reads_it(overrides):
    plan = plan_of(*overrides)
    t = plan.blast_radius["timeouts"]
    assert plan.valid and _ordered(t), t
    assert set(t["derived"]) == {"progress_deadline_s", "quorum_s", "timeout_s"}
    fo = plan.spec.failover  # resolved: what the coordinator and the collectives are given
    assert fo.timeout_s == t["collective_s"] and fo.quorum_s == t["quorum_s"]


@pytest.mark.parametrize("overrides, keys", [
    (["failover.progress_deadline_s=30", "failover.timeout_s=20"],
     ["failover.progress_deadline_s, failover.timeout_s"]),
    (["failover.quorum_s=50", "failover.timeout_s=40"], ["failover.quorum_s, failover.timeout_s"]),
    (["failover.quorum_s=1"], ["failover.quorum_s"]),  # not above the settle window (1.5 s here)
])
def test_a_ladder_out_of_order_is_refused_with_its_keys(overrides, keys):
    plan = plan_of(*TINY, *overrides)
    assert not plan.valid and not _ordered(plan.blast_radius["timeouts"])
    assert sorted(e.key for e in plan.errors) == sorted(keys), plan.errors


def test_the_cli_refuses_a_ladder_out_of_order_with_exit_2(tmp_path):
    r = run_cli([*TINY, "failover.progress_deadline_s=30", "failover.timeout_s=40", "failover.quorum_s=50"],
                tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "REJECTED" in r.stderr and "[failover.quorum_s, failover.timeout_s]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_plan_md_prints_the_ladder_and_the_goodput(tmp_path):
    from orchestrator.report.artifacts import write_plan

    plan = plan_of("recipe=llama3_405b")
    t = plan.blast_radius["timeouts"]
    write_plan(plan, tmp_path, figures=False)
    md = (tmp_path / "plan.md").read_text()
    assert "failover timeouts:" in md
    assert (f"settle window {t['settle_s']:.1f} s < quorum {t['quorum_s']:.1f} s (derived) < collective timeout "
            f"{t['collective_s']:.1f} s (derived); hang deadline {t['hang_deadline_s']:.1f} s (derived)") in md
    assert f"stall deadline {t['stall_s']:.1f} s" in md and "aborts the survivors' pending cross-copy" in md
    assert f"TCP keepalive {t['keepalive_s']:.0f} s" in md
    assert "goodput: predicted ETTR" in md
    slurm = plan_of("recipe=llama3_405b", "launcher=slurm", "failover.lease_s=20")
    write_plan(slurm, tmp_path / "slurm", figures=False)
    assert "standby on the last node takes over when the lease expires (20" in (tmp_path / "slurm" / "plan.md").read_text()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import failover_sim

    copies = plan_of(*failover_sim.CONFIGS["16k-128"], "launcher=slurm")  # 16k ranks, 128 copies in place
    write_plan(copies, tmp_path / "copies", figures=False)
    md = (tmp_path / "copies" / "plan.md").read_text()
    assert "rebuilds its cross-copy groups through the job's store, 4 shards at once" in md, md  # 16,384 / 4,096


def test_the_slurm_supervisor_settles_by_the_plans_window(tmp_path):
    """The settle window SLURM failures are gathered in is plan.md's W (below the quorum), not one
    derived from SLURM's node-down wait (16.5 s by default, above a 10 s quorum)."""
    from orchestrator.launch.srun import SrunWorkers
    from orchestrator.plan.timeouts import from_plan

    plan = plan_of(*TINY, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=1")
    workers = SrunWorkers(plan.spec, tmp_path, ["n1", "n2"])
    workers.timeouts(plan.to_json())
    t = plan.blast_radius["timeouts"]
    assert workers.settle == t["settle_s"] < t["quorum_s"] and workers.deadline == t["hang_deadline_s"]
    bare = {"step": {"wall_s": plan.step.wall_s}, "blast_radius": {"checkpoint_seconds": 0.0}}  # an older plan.json
    assert from_plan(bare, plan.spec.failover)["settle_s"] <= t["settle_s"] + 1e-9


def test_goodput_weighs_the_llama3_failure_mix_by_kind():
    from orchestrator.plan import goodput

    assert sum(n for _, n, _ in goodput.LLAMA3_TABLE5) == 419  # Llama 3, section 3.3.4, Table 5
    shares = goodput.mix_shares()
    assert sum(shares.values()) == pytest.approx(1.0) and shares["crash"] == pytest.approx(324 / 419)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import failover_sim

    assert failover_sim.LLAMA3_TABLE5 is goodput.LLAMA3_TABLE5  # the benchmark replays the plan's mix
    plan = plan_of(*failover_sim.CONFIGS["16k-128"], "launcher=slurm")  # 405B, 128 copies of the state (dp_shard=1)
    t, g = plan.blast_radius["timeouts"], goodput.goodput(plan)
    cost = {k: v["in_place_s"] for k, v in g["by_kind"].items()}
    # in place the step in flight is finished from the survivors' gradients: the lost copy's 16 micro-batches
    # over the 128 copies (a spare in its place) is 1 a copy, through 16 stages (1F1B: 15 of fill and drain)
    # of the plan's slowest stage, then the cross-copy all-reduce (the DP traffic): seconds, not the 14 s step
    d, st, redo = plan.layout, plan.step, goodput.recompute(plan)
    per_mb = (st.wall_compute + st.wall_tp + st.wall_cp + st.wall_ep) / d.microbatches
    assert (d.pp, d.microbatches, d.dp_replicate, d.dp_shard) == (16, 16, 128, 1)
    assert (redo["lost_microbatches"], redo["microbatches"]) == (16, 1)
    assert redo["seconds"] == pytest.approx((1 + 15) * per_mb + plan.axes["dp"].seconds)
    assert redo["seconds"] < plan.step.wall_s
    assert g["in_place"] and cost["crash"] == pytest.approx(g["rebuild_s"] + redo["seconds"])
    # known, then aborted: a hang at the stall deadline (and the supervisor's poll); a node lost or cut off
    # when its copy's leader's connection goes unanswered (K) or, on another node of the copy, when the
    # copy's ranks stall; SLURM's word (330 s by default here) comes later. Never the collective timeout.
    poll = plan.spec.launcher.poll_s
    assert cost["hang"] == pytest.approx(cost["crash"] + t["stall_s"] + poll)
    assert cost["crash"] + t["keepalive_s"] < cost["node"] == cost["partition"] < cost["hang"]
    assert cost["drain"] == cost["crash"] and cost["hang"] < cost["crash"] + t["collective_s"]  # a drain is planned
    one_node = goodput.goodput(plan_of(*failover_sim.CONFIGS["16k-8"], "launcher=slurm"))  # copies of one node
    one = {k: v["in_place_s"] for k, v in one_node["by_kind"].items()}
    assert one["partition"] == one["node"] == pytest.approx(one["crash"] + t["keepalive_s"])
    assert 0.9 < g["predicted_ettr"] < 1.0 and 0 < g["restart_share"] < 0.01
    # the supervisor's node is taken only by the kinds that take a node away (1 in `nodes` of them); a
    # failure that finds no spare shrinks the copies in place (the chance it finds none: every failed node in
    # repair, a Poisson count; the pool the smallest that keeps it under SPARE_MISS)
    mix = [("a", 1, "crash")]
    crash_only = goodput.goodput(plan, mix)
    assert crash_only["restart_share"] == 0.0 and crash_only["no_spare_chance"] == pytest.approx(
        goodput.no_spare_chance(g["spare_copies"], goodput.REPAIR_S / (plan.blast_radius["job_mtbf_hours"] * 3600)))
    assert crash_only["no_spare_chance"] <= goodput.SPARE_MISS < goodput.no_spare_chance(
        g["spare_copies"] - 1, goodput.REPAIR_S / (plan.blast_radius["job_mtbf_hours"] * 3600))
    # the checkpoint level: a peer-memory snapshot at Young/Daly's interval on the failures that restart
    assert g["checkpoint_level"] == "peer_memory" and g["checkpoint_overhead"] == pytest.approx(
        g["snapshot_s"] / g["checkpoint_interval_s"])
    rate = g["restart_share"] / (plan.blast_radius["job_mtbf_hours"] * 3600)
    young = (2 * g["snapshot_s"] / rate) ** 0.5
    assert young <= g["checkpoint_interval_s"] < young + plan.step.wall_s  # a whole number of steps
    one_copy = plan_of("recipe=llama3_405b")  # FSDP over all 64 DP ranks: one copy, so every failure restarts
    g1 = goodput.goodput(one_copy)
    assert not g1["in_place"] and g1["restart_share"] == 1.0 and g1["predicted_ettr"] < g["predicted_ettr"]
    assert g1["checkpoint_level"] == "file_system" and g1["checkpoint_interval_s"] == (
        one_copy.blast_radius["checkpoint_interval_s"])


def test_the_chance_a_failure_finds_no_spare():
    """P(at least s of the failed nodes still in repair), their count Poisson with mean `load`."""
    import math

    from orchestrator.plan.goodput import no_spare_chance

    assert no_spare_chance(0, 1.3) == 1.0 and no_spare_chance(1, 1.0) == pytest.approx(1 - math.exp(-1.0))
    assert no_spare_chance(3, 1.3) == pytest.approx(1 - math.exp(-1.3) * (1 + 1.3 + 1.3 ** 2 / 2))

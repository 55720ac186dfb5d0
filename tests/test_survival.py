"""What really fails, at the sizes the plans are for (#23): a run never says it finished with
steps missing; after a node loss every whole surviving replica goes on with the global batch
exact (micro-batches split unevenly, gradients weighted so the update is the full batch's).
Losses against the uninterrupted single-process run (tiny_losses)."""
import json

import pytest

from conftest import losses_by_step, plan_of, run_cli, samples_read

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
          "training.global_batch=16", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4",
          "failover.quorum_s=5", "fault.kill_node=1", "fault.at_step=3"]


def _check(r, run, reference, steps):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = losses_by_step(run)
    assert sorted(got) == list(range(steps))
    assert [got[s] for s in range(steps)] == pytest.approx(reference[:steps], rel=1e-5)
    assert samples_read(run) == list(range(steps * 16))  # every sample once, per step that counts
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and f"all {steps} steps" in status["message"]
    return [e for e in json.loads((run / "failover.json").read_text())]


def test_in_place_refused_falls_back_to_restart_and_finishes_every_step(tmp_path, tiny_losses):
    """The issue's repro: 3 copies cannot split the batch evenly (batch_policy=even), so in
    place is refused; the run must restart from its checkpoint, not report success at step 3."""
    r = run_cli([*COMMON, "layout.dp_shard=1", "training.steps=8", "training.checkpoint.every=2",
                 "failover.batch_policy=even"], tmp_path, timeout=600)
    refused, restart = _check(r, tmp_path / "run", tiny_losses, 8)
    assert refused["mode"] == "in_place_refused" and "evenly" in refused["reason"]
    assert restart["mode"] == "restart" and restart["new_layout"]["dp"] == 2 and restart["resumed_from_step"] == 2
    assert "FAILOVER 1 (restart" in r.stdout


def test_survivors_that_do_not_divide_the_batch_keep_it_exact_in_place(tmp_path, tiny_losses):
    """4 copies, one lost: 3 go on in place with 16 samples as 6 + 5 + 5, the same losses."""
    r = run_cli([*COMMON, "layout.dp_shard=1", "training.steps=6"], tmp_path, timeout=600)
    (event,) = _check(r, tmp_path / "run", tiny_losses, 6)
    assert event["mode"] == "in_place" and event["new_layout"]["dp"] == 3 and event["steps_lost"] == 0
    plan = json.loads((tmp_path / "run" / f"attempt{event['attempt']}" / "plan.json").read_text())
    assert plan["config"]["training"]["uneven_batch"] and plan["layout"]["microbatches"] == 6


def test_restart_on_survivors_that_do_not_divide_the_batch_pads_the_short_replicas(tmp_path, tiny_losses):
    """One copy sharded over 4 (FSDP): restart on 3 nodes, dp 3, 6 + 5 + 5 samples; the two
    short replicas run a padding micro-batch that weighs nothing (FSDP counts micro-batches)."""
    r = run_cli([*COMMON, "training.steps=6", "training.checkpoint.every=2"], tmp_path, timeout=600)
    (event,) = _check(r, tmp_path / "run", tiny_losses, 6)
    assert event["mode"] == "restart" and event["new_layout"]["dp"] == 3 and event["new_layout"]["nodes"] == 3


def test_the_plan_says_what_a_node_loss_costs_and_keeps_every_whole_replica():
    """llama3_405b on 1,024 nodes (replicas of 16 nodes): one node lost leaves 63 whole replicas."""
    from orchestrator.plan.replan import replan_on_survivors

    plan = plan_of("recipe=llama3_405b", "launcher=dry")
    loss = plan.blast_radius["after_node_loss"]
    per = plan.blast_radius["gpus_per_replica"] // plan.spec.hardware.gpus_per_node
    assert loss["nodes"] == (plan.spec.cluster.nodes - 1) // per * per and loss["dp"] == plan.layout.dp - 1
    assert loss["global_batch"] == plan.spec.training.global_batch and loss["uneven_batch"]
    assert loss["step_s"] > plan.step.wall_s
    # the slowest replica's micro-batches set the step: more than the even share, at least ceil(M / dp)
    assert loss["microbatches"] >= -(-plan.spec.training.global_batch // loss["dp"])
    even = replan_on_survivors(plan_of("recipe=llama3_405b", "launcher=dry", "failover.batch_policy=even"),
                               plan.spec.cluster.nodes - 1)
    assert even.plan.layout.dp < loss["dp"]  # the old rule halves the job


def test_the_uneven_split_reads_every_sample_once():
    from orchestrator.train.data import TokenSource, share

    src = TokenSource(vocab=64, seq_len=8)
    for M, dp, b in ((16, 3, 1), (2048, 63, 1), (12, 5, 2)):
        counts = [share(M, dp, r)[1] for r in range(dp)]
        assert sum(counts) == M and max(counts) - min(counts) <= 1
        got = [i for r in range(dp) for i in src.indices(2, M * b, dp, r, b)]
        assert got == list(range(2 * M * b, 3 * M * b))

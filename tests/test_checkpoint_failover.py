"""Checkpoints (DCP on fsspec), reshard on load, and failover on node loss.

Real processes with gloo, real DCP files on a local path, a file:// URL and an S3
object store (moto's server) through s3fs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, failovers, losses_by_step, run_cli, run_cli_here, samples_read

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
          "training.global_batch=16"]


def run(tmp: Path, name: str, *overrides: str, env=None, expect: int = 0):
    r = run_cli([*COMMON, *overrides], tmp / name, env=env, timeout=600)
    assert r.returncode == expect, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def uninterrupted(tiny_losses):
    return tiny_losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints at step 2: under (TP2, DP2) on a file:// URL, and under (PP2, TP2)."""
    tmp = tmp_path_factory.mktemp("saved")
    a, b = tmp / "ckpt_a", tmp / "ckpt_b"
    run(tmp, "a", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "training.steps=2",
        "training.checkpoint.every=2", f"training.checkpoint.dir=file://{a}")
    run(tmp, "b", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2",
        "training.steps=2", "training.checkpoint.every=2", f"training.checkpoint.dir={b}")
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def saved_content(saved):
    """What each saved checkpoint holds, as full tensors (read once per checkpoint for the file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cache = {}

    def content(source: str) -> dict:
        if source not in cache:
            out = saved[source].parent / f"ckpt_{source}.pt"
            dcp_to_torch_save(str(saved[source] / "step_00000002"), str(out))
            cache[source] = torch.load(out, weights_only=False)
        return cache[source]

    return content


@pytest.mark.parametrize("source,layout", [
    ("a", ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.dp=4"]),
    ("a", ["cluster.nodes=1", "hardware.gpus_per_node=1"]),
    ("b", ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2"]),  # TP1 x DP2, PP1
], ids=["TP2xDP2->DP4", "TP2xDP2->DP1", "PP2xTP2->TP1xDP2(PP1)"])
def test_checkpoint_reshards_into_another_layout(tmp_path, saved, saved_content, uninterrupted, source, layout):
    dump = tmp_path / "dump"
    url = f"file://{saved[source]}" if source == "a" else str(saved[source])
    # the plan (a dry run), then the trainer on it through a test-side wrapper that dumps what it loaded
    r = run_cli_here([*COMMON, *layout, "training.steps=3", f"training.checkpoint.dir={url}", "launcher=dry"],
                     tmp_path / "load")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan_dir = tmp_path / "load" / "run"
    world = json.loads((plan_dir / "plan.json").read_text())["world_size"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                        str(Path(__file__).parent / "load_and_dump.py"), str(plan_dir), str(dump)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    saved_state = saved_content(source)
    loaded = {"model": {}, "optim": {}}
    for f in dump.glob("rank*.pt"):
        part = torch.load(f, weights_only=False)
        for k in loaded:
            loaded[k].update(part[k])
    assert set(loaded["model"]) == set(saved_state["model"])
    for k, v in saved_state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    state = {k: v for k, v in saved_state["optim"].items() if k.startswith("state.")}
    assert state and set(state) <= set(loaded["optim"])
    for k, v in state.items():
        assert torch.equal(torch.as_tensor(loaded["optim"][k]), torch.as_tensor(v)), k
    # the next step's loss equals the uninterrupted run's
    after = losses_by_step(tmp_path / "load" / "run")
    assert list(after) == [2]
    assert after[2] == pytest.approx(uninterrupted[2], rel=1e-5)


def test_node_loss_during_a_save_reforms_dp_and_resumes_from_the_buddys_memory_snapshot(tmp_path, uninterrupted):
    """TP2 x DP2 on 2 x 2, a snapshot in host memory every step, a checkpoint every 2; node 1 dies
    inside the save of step 4 (its keeper with it): the torn save is removed, the re-plan keeps TP2
    on node 0 (DP1, the global batch kept) and resumes from the snapshot of step 3, node 1's ranks'
    shards read from node 0's keeper (their buddy), one step later than the checkpoint of step 2."""
    r = run(tmp_path, "fo", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.tp=2", "training.steps=6",
            "training.checkpoint.every=2", "training.checkpoint.keep=10", "fault.kill_node=1", "fault.at_step=4",
            "fault.mode=during_save", "training.checkpoint.snapshot_every=1")
    rd = tmp_path / "fo" / "run"
    (event,) = failovers(rd)
    assert event["node"] == 1 and "SIGKILL" in event["cause"]
    assert event["old_layout"]["dp"] == 2 and event["new_layout"]["dp"] == 1 and event["new_layout"]["tp"] == 2
    assert event["failed_after_step"] == 4
    assert event["resumed_from"] == "snapshot" and event["resumed_from_step"] == 3 and event["steps_lost"] == 1
    # every rank of the old world read back from the one keeper left: node 0's (node 1's buddy)
    restore = json.loads((rd / "attempt1" / "restore.json").read_text())
    assert restore["checkpoint_step"] == 2 and restore["world"] == 4
    assert sorted(restore["holders"]) == ["0", "1", "2", "3"] and len({a for h in restore["holders"].values()
                                                                       for a in h}) == 1
    # one copy of the state (dp_shard = dp): not in place, and it says why
    assert event["mode"] == "restart" and "one copy" in event["why_not_in_place"]
    assert "FAILOVER 1 (restart" in r.stdout and "a memory snapshot; 1 step(s) lost" in r.stdout
    assert ("resumed from the memory snapshot of step 3" in (rd / "attempt1" / "logs" / "rank0.log").read_text())
    from orchestrator.rundir.checkpoints import list_saves

    assert all(ok for _, _, ok in list_saves(str(rd / "checkpoints")))  # the torn save was cleaned up
    losses = losses_by_step(rd)
    assert sorted(losses) == list(range(6))
    for step in range(6):  # before the loss, and after the resume on the smaller layout
        assert losses[step] == pytest.approx(uninterrupted[step], rel=1e-5)
    # every sample of the stream read exactly once by the steps that count
    assert samples_read(rd) == list(range(6 * 16))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rd / "tensorboard")).Reload()
    assert "failover/dp" in acc.Tags()["scalars"]


def test_resume_with_a_changed_model_shape_is_refused(tmp_path, saved):
    ck = saved["b"]  # a save at step 2 of this model and data (read, never written, here)
    r = run_cli_here([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=3", "model.hidden=128",
                      f"training.checkpoint.dir={ck}"], tmp_path / "b")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "model.hidden" in r.stderr and "nothing was launched" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b" / "run" / "logs").exists()
    r = run_cli_here([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=3",
                      "training.global_batch=32", f"training.checkpoint.dir={ck}"], tmp_path / "c")
    assert r.returncode == 2 and "training.global_batch" in r.stderr and "allow_batch_change" in r.stderr


def test_async_checkpoint_on_an_s3_object_store(tmp_path, s3_server, uninterrupted):
    url = f"{s3_server}/run1"
    run(tmp_path, "a", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2", "training.steps=2",
        "training.checkpoint.every=2", "training.checkpoint.async_save=true", f"training.checkpoint.dir={url}")
    run(tmp_path, "b", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.tp=2", "training.steps=3",
        f"training.checkpoint.dir={url}")
    assert losses_by_step(tmp_path / "b" / "run")[2] == pytest.approx(uninterrupted[2], rel=1e-5)
    import fsspec

    import os

    fs = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=os.environ["FSSPEC_S3_ENDPOINT_URL"])
    assert fs.exists(f"{url}/step_00000002/COMPLETE")


def test_bad_fault_and_failover_settings_are_named_before_launch(tmp_path):
    r = run_cli_here([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=2", "fault.kill_node=3",
                      "failover.batch_policy=guess"], tmp_path / "bad")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    for key in ("[fault.kill_node]", "[fault.at_step]", "[failover.batch_policy]"):
        assert key in r.stderr, r.stderr
    assert "nothing was launched" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad" / "run" / "logs").exists()

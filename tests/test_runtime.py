"""The runtime trains exactly the plan: parallel runs against a single process, with
real processes and gloo (one per emulated GPU), launched by the local launcher."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import alive, run_cli

COMMON = ["hardware=cpu", "model=tiny", "training.steps=3", "launcher=local", "figures=false",
          "training.seq_len=64", "training.global_batch=16"]


def train(tmp_path: Path, name: str, *overrides: str) -> dict:
    r = run_cli([*COMMON, *overrides], tmp_path / name, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((tmp_path / name / "run" / "metrics.json").read_text())


# A clip that binds: the tiny model's global gradient norm is about 0.45 to 0.7 over these steps.
# Adam's update hardly changes under a gradient scaled by a constant, so the losses alone would not
# see a wrong norm; every run's norm is compared with the single process's, every stage and shard
# of the model counted once (train/parallel.clip_grad_norm).
MAX_NORM = 0.3
CLIP = [f"training.max_norm={MAX_NORM}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the clip binding: its losses and gradient norms."""
    return train(tmp_path_factory.mktemp("clipped"), "single", "cluster.nodes=1", "hardware.gpus_per_node=1", *CLIP)


# Each layout covers what no other one does; together every axis, every schedule, both
# recompute modes, gradient accumulation, a non-default axis order and HSDP copies. The
# TensorBoard test below covers TP alone (on a GELU model with tied embeddings), the checkpoint
# tests DP alone.
LAYOUTS = {
    # full recompute of each stage's first block only (Megatron's block method)
    "pp2_gpipe_partial_recompute": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.pp=2", "schedule=gpipe",
                                    "training.recompute=full", "training.recompute_layers=1"],
    "pp2_interleaved": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.pp=2", "schedule=interleaved_1f1b",
                        "layout.vp=2"],
    "pp2_dualpipev": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.pp=2", "schedule=dualpipev"],
    # two micro-batches per rank (gradient accumulation), data-parallel ranks innermost, ZeRO-2
    # (weights kept gathered from forward to backward)
    "tp2_dp2_microbatched_dp_inner_zero2": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2",
                                            "layout.dp=2", "training.micro_batch=2", "layout.order=[dp,tp]",
                                            "layout.zero=2"],
    "cp2_pp2_zero_bubble": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.cp=2", "layout.pp=2",
                            "schedule=zero_bubble"],
    "cp2_selective_recompute": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.cp=2",
                                "training.recompute=selective"],
    "pp2_tp2_dp2_1f1b_full_recompute": ["cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2",
                                        "layout.dp=2", "schedule=1f1b", "training.recompute=full"],
    "dp4_hsdp_two_copies": ["cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4", "layout.dp_shard=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_run_matches_single_process(tmp_path, reference, name):
    """Losses and the global gradient norm (clipped at MAX_NORM, which it exceeds) of one process."""
    got = train(tmp_path, name, *LAYOUTS[name], *CLIP)
    assert len(got["loss"]) == len(reference["loss"]) == len(got["grad_norm"]) == 3
    for step, (a, b) in enumerate(zip(got["loss"], reference["loss"])):
        assert a == pytest.approx(b, rel=1e-5), (name, step, a, b)
    for step, (a, b) in enumerate(zip(got["grad_norm"], reference["grad_norm"])):
        assert a == pytest.approx(b, rel=1e-5) and a > MAX_NORM, (name, step, a, b)
    assert got["loss"][-1] < got["loss"][0]  # it trains


@pytest.mark.parametrize("mode, layers", [("full", None), ("full", 1), ("selective", None)])
def test_recompute_wraps_the_planned_parts_and_keeps_the_gradients(mode, layers):
    """In one process: checkpointed modules give the same gradients, and the names the
    checkpoint uses do not change; `training.recompute_layers` wraps the first blocks only."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from conftest import plan_of
    from orchestrator.train.model import Transformer
    from orchestrator.train.parallel import apply_recompute

    cfg = plan_of("hardware=cpu", "model=tiny").spec.model
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        m = Transformer(cfg)
        names = set(get_model_state_dict(m))
        if wrap:
            apply_recompute(m, mode, layers)
            wrapped = [x for x in m.modules() if isinstance(x, CheckpointWrapper)]
            assert len(wrapped) == (layers or 4 if mode == "full" else 4 * 4)
            if layers:
                assert [isinstance(b, CheckpointWrapper) for b in m.layers.values()] == [True, False, False, False]
            assert set(get_model_state_dict(m)) == names
        x = torch.randint(0, cfg.vocab, (2, 32))
        m(x).float().logsumexp(-1).mean().backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    for (k, a), b in zip(grads[0].items(), grads[1].values()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_gelu_tied_embeddings_under_tensor_parallelism_and_tensorboard_events(tmp_path):
    """TP alone on a model with a GELU MLP and tied embeddings: the losses of its own single process.
    The TP run's TensorBoard events hold the scalars and the plan."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dense = ["model.mlp=gelu", "model.tied_embeddings=true", "training.adam_eps=0.01"]
    single = train(tmp_path, "single", "cluster.nodes=1", "hardware.gpus_per_node=1", *dense)
    got = train(tmp_path, "tb", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.tp=2", *dense)
    assert len(got["loss"]) == len(single["loss"]) == 3
    assert got["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert single["loss"][-1] < single["loss"][0]
    acc = EventAccumulator(str(tmp_path / "tb" / "run" / "tensorboard")).Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/train", "time/step_s", "throughput/tokens_per_s", "perf/tflops_per_gpu",
                "perf/tflops_per_gpu_predicted", "perf/mfu", "perf/mfu_predicted", "memory/max_rss_mb",
                "memory/rank0_mb", "memory/rank1_mb", "grad/norm"):
        assert tag in tags, tag
    assert len(acc.Scalars("loss/train")) == 3
    assert "plan/text_summary" in acc.Tags()["tensors"]  # the plan itself, as text
    text = acc.Tensors("plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "TP2 CP1 PP1 DP1" in text
    assert [e.value for e in acc.Scalars("loss/train")] == pytest.approx(got["loss"], rel=1e-6)
    # the global gradient norm (training.max_norm=1.0 by default: it clips, so it reports the norm)
    assert [e.value for e in acc.Scalars("grad/norm")] == pytest.approx(got["grad_norm"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)


def test_killing_one_rank_stops_the_job_and_names_it(tmp_path):
    from orchestrator import compose, make_plan
    from orchestrator.report.artifacts import write_plan
    from orchestrator.launch.processes import LocalJob

    run = tmp_path / "run"
    plan = make_plan(compose([*COMMON, "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                              "training.steps=1000"]))
    write_plan(plan, run, figures=False)
    job = LocalJob(run, nodes=2, gpus_per_node=2, echo=False)
    job.start()
    log0 = run / "logs" / "rank0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log0.exists() and "step 2/" in log0.read_text()):
        time.sleep(0.2)
    assert "step 2/" in log0.read_text()
    victim = job.procs[3].pid
    os.kill(victim, signal.SIGKILL)
    # as the launcher waits: every failure of the settle window is seen before one is named (its peers
    # die of it an instant later, and may be reported first on a loaded machine)
    from orchestrator.plan import timeouts

    settle = timeouts.from_plan(json.loads((run / "plan.json").read_text()), plan.spec.failover)["settle_s"]
    res = job.wait(timeout=60, settle_s=settle)
    assert not res.ok and res.failed_rank == 3 and res.failed_node == 1
    assert "SIGKILL" in res.cause and "rank 3" in res.cause
    assert not any(alive(pid) for pid in res.pids)


def test_a_rank_logs_with_its_rank_and_level_and_exits_with_the_status_only_at_its_entry_point(tmp_path):
    """A rank that cannot run (its WORLD_SIZE is not the plan's) ends with exit status 1 and one
    ERROR line in its log, `[rank N] ERROR ...`, naming both numbers: no traceback. The console
    shows the same line without the rank prefix (rundir.rank_message)."""
    import subprocess
    import sys

    from conftest import ROOT
    from orchestrator import compose, make_plan, rundir
    from orchestrator.report.artifacts import write_plan

    run = tmp_path / "run"
    write_plan(make_plan(compose([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2"])), run,
               figures=False)
    env = dict(os.environ, RANK="1", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "orchestrator.train.worker", str(run)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == rundir.EXIT_FAILED, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if "WORLD_SIZE" in x]
    assert line.startswith("[rank 1] ERROR the job has WORLD_SIZE 3 but the plan needs 2")
    assert rundir.rank_message(line).startswith("ERROR the job has WORLD_SIZE 3")
    assert rundir.rank_message("[rank 12] INFO step 3/4 | loss 1.0") == "step 3/4 | loss 1.0"

"""Mixture of experts and expert parallelism in the runtime, against single-process runs.

Adam hides a gradient that is off by a constant factor (its update is scale-free up to
eps), and the loss moves little in a few steps. So these runs use a large adam_eps, and
the parity checks compare the weights after 4 steps as well as the losses: an expert
gradient averaged over the wrong group then shows in the weights by orders of magnitude
more than the tolerance. Every run clips the gradients' global norm at MAX_NORM, below the
tiny MoE's (about 0.42 to 0.51): with the large eps the clip moves the weights, and each run's
norm is compared with the single process's (experts sharded over EP and edp, stages, TP, CP)."""
import json
import shutil
from pathlib import Path

import pytest

from conftest import failovers, losses_by_step, run_cli, run_cli_here

MAX_NORM = 0.3
COMMON = ["hardware=cpu", "model=tiny_moe", "launcher=local", "figures=false", "training.adam_eps=0.01",
          f"training.max_norm={MAX_NORM}"]


def run(tmp: Path, name: str, *overrides: str, expect: int = 0):
    r = run_cli([*COMMON, *overrides], tmp / name, timeout=600)
    assert r.returncode == expect, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def metrics(tmp: Path, name: str) -> dict:
    return json.loads((tmp / name / "run" / "metrics.json").read_text())


SAVE = ["training.checkpoint.every=2", "training.checkpoint.keep=10"]


def weights(tmp: Path, name: str, step: int = 4) -> dict:
    """The model's tensors (full, unsharded) in a run's checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{name}_step{step}.pt"
    dcp_to_torch_save(str(tmp / name / "run" / "checkpoints" / f"step_{step:08d}"), str(out))
    return torch.load(out, weights_only=False)["model"]


def _same_weights(got: dict, want: dict, earlier: dict) -> None:
    """Each tensor at step 4 within 2% of what the reference moved it over steps 2-4.

    Not element-wise: a router score that ties to the last bit can send one token to another
    expert on another CPU, which moves a few elements by a fraction of a step. A gradient off
    by a factor moves the whole tensor by tens of percent of a step."""
    assert set(got) == set(want)
    for k, v in want.items():
        moved = (v - earlier[k]).norm().item()
        off = (got[k] - v).norm().item()
        assert off <= 0.02 * moved + 1e-7, (k, off, moved)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """One process, all experts local, 6 steps, saved at steps 4 and 6."""
    tmp = tmp_path_factory.mktemp("moe_ref")
    run(tmp, "single", "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=6", *SAVE)
    return tmp


@pytest.fixture(scope="module")
def reference(ref_dir):
    return metrics(ref_dir, "single")["loss"]


@pytest.fixture(scope="module")
def ref_norms(ref_dir):
    return metrics(ref_dir, "single")["grad_norm"]


def _same_norms(got: list[float], want: list[float]) -> None:
    """The global gradient norm of each step as the single process's, and above the clip (it binds)."""
    assert got and len(got) <= len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=1e-5) and a > MAX_NORM, (step, a, b)


@pytest.fixture(scope="module")
def ref_weights(ref_dir):
    """The reference's tensors at step 4 and at step 2 (read once for the file)."""
    return weights(ref_dir, "single"), weights(ref_dir, "single", 2)


def _same(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) <= len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=rel), (step, a, b)


LAYOUTS = {
    # EP groups span the tensor ranks (etp = 1: each routes its sequence shard), with recompute;
    # experts not sharded further (edp = 1): their gradients scaled by the trainer
    "tp2_dp2_ep4_full_recompute": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.etp=1",
                                   "layout.ep=4", "training.recompute=full"],
    "cp2_ep2_selective_recompute": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.cp=2", "layout.ep=2",
                                    "training.recompute=selective"],
    "pp2_ep2_interleaved": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.pp=2", "layout.ep=2",
                            "schedule=interleaved_1f1b", "layout.vp=2", "model.moe.dense_layers=0"],
    "pp2_ep2_dualpipev": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.pp=2", "layout.ep=2",
                          "schedule=dualpipev"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(tmp_path, ref_weights, reference, ref_norms, name):
    overrides = LAYOUTS[name]
    ref, norms, own_weights = reference, ref_norms, None
    if "model.moe.dense_layers=0" in overrides:  # a different model: its own reference
        run(tmp_path, "single", "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=4",
            "model.moe.dense_layers=0", *SAVE)
        ref, norms, own_weights = (metrics(tmp_path, "single")["loss"], metrics(tmp_path, "single")["grad_norm"],
                                   (weights(tmp_path, "single"), weights(tmp_path, "single", 2)))
    run(tmp_path, name, *overrides, "training.steps=4", *SAVE)
    got = metrics(tmp_path, name)["loss"]
    assert len(got) == 4
    _same(got, ref)
    _same_norms(metrics(tmp_path, name)["grad_norm"], norms)
    assert got[-1] < got[0]
    want, earlier = own_weights or ref_weights
    _same_weights(weights(tmp_path, name), want, earlier)


def test_contract_command_trains_and_checkpoints_reshard_across_ep(tmp_path, reference):
    """The issue's command (EP4 x PP2 on 2 x 4), saving at step 2; the save then loads under
    EP2 and without EP, and both go on exactly as the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    r = run(tmp_path, "contract", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.ep=4", "layout.pp=2",
            "training.steps=4", "training.checkpoint.every=2", "training.checkpoint.keep=10",
            f"training.checkpoint.dir={ckpt}")
    assert "EP4" in r.stdout
    _same(metrics(tmp_path, "contract")["loss"], reference)
    for name, layout in (("ep2", ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.ep=2"]),
                         ("no_ep", ["cluster.nodes=1", "hardware.gpus_per_node=1"])):
        one = tmp_path / f"ckpt_{name}"
        shutil.copytree(ckpt / "step_00000002", one / "step_00000002")
        run(tmp_path, name, *layout, "training.steps=4", f"training.checkpoint.dir={one}")
        after = losses_by_step(tmp_path / name / "run")
        assert sorted(after) == [2, 3]
        for step in (2, 3):
            assert after[step] == pytest.approx(reference[step], rel=1e-5), (name, step)


def test_experts_sharded_over_edp_match_and_report_load_and_traffic(tmp_path, ref_weights, reference, ref_norms):
    """EP2 over DP4 on 2 x 2: edp = 2, the experts FSDP-sharded over the expert data-parallel
    group. Losses, gradient norms and weights as the single process; TensorBoard shows the load
    and traffic."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, "tb", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.ep=2", "training.steps=4", *SAVE)
    _same(metrics(tmp_path, "tb")["loss"], reference)
    _same_norms(metrics(tmp_path, "tb")["grad_norm"], ref_norms)
    _same_weights(weights(tmp_path, "tb"), *ref_weights)
    rd = tmp_path / "tb" / "run"
    acc = EventAccumulator(str(rd / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tags = set(acc.Tags()["scalars"])
    plan = json.loads((rd / "plan.json").read_text())
    tokens = plan["config"]["training"]["global_batch"] * plan["config"]["training"]["seq_len"]
    for layer in (1, 2, 3):  # layer 0 is dense
        per_expert = [acc.Scalars(f"moe/tokens/layer{layer}/expert{e}")[-1].value for e in range(8)]
        assert sum(per_expert) == tokens * 2  # every token to its top-2, over the global batch
        assert f"moe/imbalance/layer{layer}" in tags
    assert "moe/tokens/layer0/expert0" not in tags
    assert acc.Scalars("time/ep_all_to_all_s_max")[-1].value > 0
    # The plan's all-to-all bytes per step per GPU against what the runtime sent (counted in
    # the all-to-all calls: rows to other ranks x row bytes, dispatch and combine, forward and
    # backward). The plan assumes uniform routing; the runtime's routing is what it is.
    (ep,) = [a for a in plan["axes"] if a["name"] == "ep"]
    sent = metrics(tmp_path, "tb")["ep_bytes_per_rank"]
    for step in sent:
        mean = sum(step) / len(step)
        assert mean == pytest.approx(ep["bytes_per_step"], rel=0.15), (mean, ep["bytes_per_step"])


def test_auxiliary_balance_loss_over_sequence_shards_matches_single_process(tmp_path, reference):
    """The sequence-wise balance loss sums its statistics over the sequence's TP and CP shards."""
    aux = ["model.moe.aux_loss_coef=0.5", "training.steps=3"]  # the file's model and data, an auxiliary loss added
    run(tmp_path, "single", "cluster.nodes=1", "hardware.gpus_per_node=1", *aux)
    run(tmp_path, "tp2_cp2_ep4", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.etp=1",
        "layout.cp=2", "layout.ep=4", *aux)
    ref, got = metrics(tmp_path, "single")["loss"], metrics(tmp_path, "tp2_cp2_ep4")["loss"]
    _same(got, ref)
    # the loss acts: the same run without it (the file's reference: aux_loss_coef 0, all else equal) starts
    # from the same loss and moves apart once the auxiliary loss has taken part in an update
    assert reference[0] == pytest.approx(ref[0], rel=1e-5) and reference[1:3] != pytest.approx(ref[1:], rel=1e-5)


def test_node_loss_keeps_ep_on_the_survivors(tmp_path, reference):
    """EP2 over DP4 on 2 nodes; node 1 dies: the re-plan keeps EP2 on one node (DP2, edp 1)
    and the run resumes from the checkpoint exactly as the uninterrupted one."""
    run(tmp_path, "fo", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.ep=2", "training.steps=6",
        "training.checkpoint.every=2", "training.checkpoint.keep=10", "fault.kill_node=1", "fault.at_step=3")
    rd = tmp_path / "fo" / "run"
    (event,) = failovers(rd)
    assert event["old_layout"]["dp"] == 4 and event["new_layout"]["dp"] == 2
    assert event["new_layout"]["ep"] == 2
    losses = losses_by_step(rd)
    assert sorted(losses) == list(range(6))
    for step in range(6):
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), step


def test_replan_says_why_ep_cannot_survive(tmp_path):
    from orchestrator.config.compose import compose
    from orchestrator.plan.make import make_plan
    from orchestrator.plan.replan import replan_on_survivors

    spec = compose(["hardware=cpu", "model=tiny_moe", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.ep=8"])
    plan = make_plan(spec)
    out = replan_on_survivors(plan, 1)
    assert out.plan is None
    reason = " ".join(out.problems)
    assert "etp*ep*pp = 8 does not divide 4" in reason, reason


@pytest.mark.parametrize("name,overrides,problem", [
    ("etp", ["layout.tp=2", "layout.ep=2", "layout.etp=2"], "layout.etp"),
    ("copies", ["layout.ep=2", "layout.dp_shard=2"], "layout.dp_shard"),
])
def test_runtime_refuses_what_it_does_not_run_before_launch(tmp_path, name, overrides, problem):
    r = run_cli_here([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=4", *overrides], tmp_path / name)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert problem in r.stdout + r.stderr
    assert not (tmp_path / name / "run" / "logs").exists()

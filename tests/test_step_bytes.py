"""The once-a-step memory traffic plan/kernels.step_features prices for an FSDP2 stack, against what
torch's own FSDP2, clip_grad_norm_ and AdamW read and write (tests/fsdp2_bytes.py counts it op by
op on 2 gloo ranks)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def counted() -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fsdp2_bytes.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _elems(ops: dict) -> int:
    return sum(o["read_elems"] + o["write_elems"] for o in ops.values())


def _bytes(ops: dict) -> int:
    return sum(o["read_bytes"] + o["write_bytes"] for o in ops.values())


def test_fsdp2_copies_every_gathered_weight_out_and_every_gradient_in_per_micro_batch(counted):
    """reshard_after_forward=True: each unit's weights gathered for its forward and again for its
    backward, copied out of the all-gather's buffer (read and written, bf16); every backward's
    reduce-scatter copies the unsharded bf16 gradients into its fp32 input (reduce_dtype)."""
    u, m, units = counted["unsharded_elems"], counted["microbatches"], counted["units"]
    out, cin = counted["fsdp"]["fsdp.split_with_sizes_copy"], counted["fsdp"]["fsdp.chunk_cat"]
    gathers, reduces = 2 * m, m
    assert out["calls"] == units * gathers and cin["calls"] == units * reduces
    assert out["read_elems"] == out["write_elems"] == gathers * u
    assert cin["read_elems"] == cin["write_elems"] == reduces * u
    assert _bytes({"o": out}) == gathers * u * 2 * counted["param_bytes"]
    assert _bytes({"i": cin}) == reduces * u * (counted["param_bytes"] + counted["reduce_bytes"])


def test_adamw_and_the_clip_touch_the_tensors_the_plan_prices(counted):
    """Per element of the rank's fp32 shard: fused AdamW (torchtitan's default implementation, and
    this runtime's on a GPU) reads the parameter, its gradient and both moments and writes all but
    the gradient (ADAMW_BYTES); foreach clip_grad_norm_ reads the gradients for the norm, then
    scales them (CLIP_BYTES). foreach AdamW makes eight passes instead: 20 element accesses."""
    from orchestrator.plan.kernels import ADAMW_BYTES, CLIP_BYTES

    s = counted["shard_elems"]
    assert _elems(counted["fused"]["adamw"]) == s * ADAMW_BYTES / 4
    assert _bytes(counted["fused"]["adamw"]) == s * ADAMW_BYTES
    for impl in ("fused", "foreach"):
        assert _bytes(counted[impl]["clip"]) == s * CLIP_BYTES
    foreach = counted["foreach"]["adamw"]
    assert _elems(foreach) == 20 * s, foreach


def test_step_features_prices_the_bytes_torch_moves(counted):
    """The planner's own layout and stage for the toy's shape (stack=torchtitan: FSDP2, fp32
    gradient reduce; 2 ranks sharding one copy, the toy's micro-batches): step_features' bytes are
    the ones counted (fused AdamW, the clip, FSDP2's copy-out and copy-in)."""
    from orchestrator import compose
    from orchestrator.config.schema import clip_norm
    from orchestrator.plan.kernels import step_features
    from orchestrator.plan.plan import shape_plan

    m, world = counted["microbatches"], counted["world"]
    spec = compose(["model=tiny", "stack=torchtitan", "hardware=h100_sxm", "cluster.nodes=1",
                    f"hardware.gpus_per_node={world}", f"layout.dp={world}", f"training.global_batch={world * m}"])
    shaped = shape_plan(spec)
    d = shaped.layout
    assert (d.tp, d.pp, d.cp, d.dp_shard, d.zero, d.microbatches) == (1, 1, 1, world, 3, m)
    assert spec.stack.gather_copy_out and (spec.stack.grad_reduce_bytes or spec.stack.grad_bytes) == \
        counted["reduce_bytes"]
    st = replace(shaped.stages[0], params=float(counted["unsharded_elems"]), expert_params=0.0)
    clip = clip_norm(spec.training.max_norm, spec.stack.grad_clip) > 0  # torchtitan's default: 1.0
    got = step_features(st, d, spec.stack, hbm=1.0, clip=clip).elem
    torch_bytes = (_bytes(counted["fused"]["adamw"]) + _bytes(counted["fused"]["clip"])
                   + _bytes(counted["fsdp"]))
    assert got == pytest.approx(torch_bytes, rel=1e-12), (got, torch_bytes)


def test_the_clip_is_priced_where_the_run_clips():
    """training.max_norm=0 (or a stack that never clips) takes the clip out of the step the plan
    prices, for this runtime as for Megatron-LM: the optimizer step reads the gradients once less."""
    from conftest import plan_of

    run = ["hardware=h100_sxm", "model=llama3_8b", "cluster.nodes=1", "layout.tp=8", "training.global_batch=8"]
    for stack in ("orchestrator", "megatron_core"):
        clipped = plan_of(*run, f"stack={stack}").step.wall_s
        off = plan_of(*run, f"stack={stack}", "training.max_norm=0").step.wall_s
        assert off < clipped, (stack, off, clipped)
        assert plan_of(*run, f"stack={stack}", "stack.grad_clip=false").step.wall_s == off

"""Run as a script (2 gloo processes on CPU): the bytes torch's own FSDP2 and optimizer code move
once per training step, counted op by op under a TorchDispatchMode, for plan/kernels.step_features.

A toy of bias-free nn.Linear layers: two blocks of two layers, each block its own `fully_shard`
unit, and the root (an input and an output layer) one too, every unit with
reshard_after_forward=True and torchtitan's mixed precision (bf16 parameters, fp32 gradient
reduce). One step: forward, backward, torch.nn.utils.clip_grad_norm_(foreach=True), AdamW.step().
Counted per rank:
- FSDP2's copy-out of each weight all-gather (torch.ops.fsdp.split_with_sizes_copy) and its
  reduce-scatter copy-in (torch.ops.fsdp.chunk_cat): bytes read and written, and how many ran;
- the clip's and AdamW's ops (foreach=True, and fused=True: torchtitan's default implementation),
  a second step's (the first step's exp_avg_sq is zeros, which a multiply leaves unchanged): per
  element of the rank's parameter shard, the tensors each op reads (distinct inputs) and writes
  (fresh outputs, and mutable inputs whose values it changed: a fused kernel's gradients are
  declared mutable for AMP's unscaling but written only with a grad_scale).
Prints one JSON object (rank 0's counts; both ranks' are asserted equal)."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HIDDEN, FFN, BATCH = 32, 64, 4
WORLD, MICRO = 2, 2  # ranks, micro-batches a step


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(HIDDEN, 16, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _tensors(x) -> list:
    return [_local(t) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Count(TorchDispatchMode):
    """The ops named in `watch` (their overload packet's qualified name): per op, how many ran and
    the bytes and elements (0-dim tensors left out: the step counters, norms and clip factors) they
    read and wrote."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch
        self.ops: dict[str, dict] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func._opname}"
        if not self.watch(name):
            return func(*args, **kwargs)
        schema = func._schema
        reads, mutable, out_only = [], [], []
        bound = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments
                                                      if a.name in kwargs]
        for arg, val in bound:
            ts = [t for t in _tensors(val) if t.dim() > 0]
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and arg.kwarg_only:  # out=: written, not read
                out_only += ts
                continue
            seen = {id(t) for t in reads}
            reads += [t for t in ts if id(t) not in seen]
            if written:
                mutable += ts
        before = [t.clone() for t in mutable]
        result = func(*args, **kwargs)
        changed = [t for t, b in zip(mutable, before) if not torch.equal(t, b)]
        fresh = [t for t in _tensors(result) if t.dim() > 0 and all(t is not m for m in mutable + out_only)]
        rec = self.ops.setdefault(name, dict(calls=0, read_bytes=0, write_bytes=0, read_elems=0, write_elems=0))
        rec["calls"] += 1
        rec["read_bytes"] += _bytes(reads)
        rec["write_bytes"] += _bytes(changed + out_only + fresh)
        rec["read_elems"] += sum(t.numel() for t in reads)
        rec["write_elems"] += sum(t.numel() for t in changed + out_only + fresh)
        return result


def _model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Toy()
    mesh = init_device_mesh("cpu", (WORLD,))
    kw = dict(mesh=mesh, reshard_after_forward=True,
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _pipelined() -> list[int]:
    """The same toy as one stage of torch's own pipelining (PipelineStage, Schedule1F1B, a pipeline group
    of one) over FSDP2 units as torchtitan shards them under pipelining (reshard_after_forward=False):
    the bytes of gradient each rank holds after each micro-batch's backward, as FSDP2 keeps them (the
    fp32 accumulation of the unsharded gradient, or the unsharded gradient itself)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    model = Toy()
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("pp", "dp"))
    kw = dict(mesh=mesh["dp"], reshard_after_forward=False,
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    states = [fully_shard.state(m) for m in (model, *model.blocks)]
    params = [fp for st in states for g in (getattr(st, "_fsdp_param_groups", None) or [st._fsdp_param_group])
              for fp in g.fsdp_params]
    held = []
    backward = stage.backward_maybe_with_nosync

    def watched(*args, **kwargs):
        out = backward(*args, **kwargs)
        grads = [fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None
                 else getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in params]
        held.append(sum(g.numel() * g.element_size() for g in grads if g is not None))
        return out

    stage.backward_maybe_with_nosync = watched
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lambda out, target: (out.float() - target).pow(2).mean())
    g = torch.Generator().manual_seed(7)
    schedule.step(torch.randn(BATCH * MICRO, HIDDEN, generator=g), target=torch.randn(BATCH * MICRO, 16, generator=g))
    return held


def worker(rank, world, outdir):
    xs = [torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(1 + rank * MICRO + i))
          for i in range(MICRO)]
    result = dict(world=world, microbatches=MICRO, units=3, param_bytes=2, reduce_bytes=4)
    for impl in ("foreach", "fused"):
        model = _model()
        params = list(model.parameters())
        result["unsharded_elems"] = sum(p.numel() for p in params)
        result["shard_elems"] = sum(_local(p).numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{impl: True})
        for _ in range(2):  # the second step's counts
            fsdp_ops = Count(lambda n: n in ("fsdp.split_with_sizes_copy", "fsdp.chunk_cat"))
            with fsdp_ops:
                for x in xs:  # gradient accumulation: FSDP2 reduce-scatters after every backward
                    model(x).float().pow(2).mean().backward()
            clip = Count(lambda n: n.startswith("aten._foreach"))
            with clip:  # a max_norm below the gradients' norm: the clip scales them
                torch.nn.utils.clip_grad_norm_(params, max_norm=1e-4, foreach=True)
            adam = Count(lambda n: n.startswith("aten._foreach") or n.startswith("aten._fused_adam"))
            with adam:
                opt.step()
            opt.zero_grad()
        result[impl] = dict(clip=clip.ops, adamw=adam.ops)
        result["fsdp"] = fsdp_ops.ops
    result["pipelined_grad_bytes"] = _pipelined()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        assert all(g == gathered[0] for g in gathered), gathered
        with open(os.path.join(outdir, "out.json"), "w") as f:
            json.dump(result, f)


def main() -> None:
    import tempfile

    from dist_util import run_workers

    with tempfile.TemporaryDirectory() as d:
        run_workers(worker, WORLD, d)
        with open(os.path.join(d, "out.json")) as f:
            print(json.dumps(json.load(f)))


if __name__ == "__main__":
    main()

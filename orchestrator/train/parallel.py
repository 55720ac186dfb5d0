"""Apply the plan's parallelism to the model with PyTorch's native APIs.

- Tensor + sequence parallel: `parallelize_module` with Colwise/Rowwise/SequenceParallel
  (seed 2: one all-reduce per attention and per MLP block, as AG + RS with SP),
  a vocabulary-parallel embedding and a vocabulary-parallel loss (`loss_parallel`).
- Context parallel: the attention all-gathers K and V inside the CP group (model.py).
- FSDP2 (`fully_shard`) over the ranks that shard one copy of the state (dps x cp), as
  torchtitan does; weights stay gathered between forward and backward under pipelining
  (the zero-bubble + FSDP2 trap in ../shared/notes/torch-cpu.md). With several copies
  (layout.dp_shard < dp: HSDP), `sync_replicas` averages the gradient shards across the
  copies over a group the runtime owns, so a lost copy can be dropped without touching
  FSDP's own groups.
- Pipeline: `torch.distributed.pipelining` stages cut exactly as plan.json lists them
  for this pipeline rank, run by the schedule class its registry entry names.

Everything layout-shaped comes from plan.json; nothing here re-derives it.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from orchestrator.config.schedules import SCHEDULES
from orchestrator.train.model import Transformer


def apply_tp(model: Transformer, tp_mesh, loss_parallel: bool) -> None:
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_cp(model: Transformer, group, cp: int, cp_rank: int) -> None:
    for block in model.layers.values():
        block.attention.cp_group, block.attention.cp, block.attention.cp_rank = group, cp, cp_rank


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation checkpointing as the plan counts it: `full` keeps only each block's input
    and re-runs the block in backward; `selective` re-runs the norms, the attention core and
    the SwiGLU activation (the cheap, activation-heavy parts). Checkpoint wrappers do not
    change the state-dict names the DCP helpers report."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(m):
        return checkpoint_wrapper(m, preserve_rng_state=False)

    for key, block in list(model.layers.items()):
        if mode == "full":
            model.layers[key] = wrap(block)
        else:
            block.attention_norm, block.ffn_norm = wrap(block.attention_norm), wrap(block.ffn_norm)
            block.attention.core = wrap(block.attention.core)
            block.feed_forward.act = wrap(block.feed_forward.act)


def apply_fsdp(model: Transformer, dp_mesh, reshard_after_forward: bool, mp: MixedPrecisionPolicy | None) -> None:
    kw = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = mp
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def build_model_parts(plan: dict, model_cfg, meshes: dict, coords: dict, seed: int, device: torch.device,
                      mp: MixedPrecisionPolicy | None, recompute: str = "none"):
    """The model chunks (virtual pipeline stages) this rank runs, parallelised: [(stage id, module)]."""
    lay, mesh = plan["layout"], meshes["dense"]
    torch.manual_seed(seed)  # every rank builds the same full model, then keeps its share
    full = Transformer(model_cfg)
    if lay["pp"] == 1:
        parts = [(0, full)]
    else:
        mine = lay["stages"][coords["pp"]]["virtual"]
        parts = [(v["stage"], copy.deepcopy(full).keep_only(*v["layers"], first=v["first"], last=v["last"]))
                 for v in mine]
        del full
    fsdp_dims = tuple(plan["mesh"]["fsdp"])
    fsdp = _flat(mesh, fsdp_dims)
    for _, part in parts:
        part.to(device)
        if lay["tp"] > 1:
            apply_tp(part, mesh["tp"], loss_parallel=True)
        if lay["cp"] > 1:
            apply_cp(part, mesh["cp"].get_group(), lay["cp"], coords["cp"])
        apply_recompute(part, recompute)
        if fsdp is not None:
            # Under pipelining the weights stay gathered between forward and backward: the
            # zero-bubble schedules give wrong gradients otherwise (../shared/notes/torch-cpu.md).
            apply_fsdp(part, fsdp, reshard_after_forward=lay["pp"] == 1, mp=mp)
    return parts


def _flat(mesh, dims: tuple[str, ...]):
    """The sub-mesh over `dims` as one dimension (None when it has a single rank)."""
    size = 1
    for d in dims:
        size *= mesh[d].size()
    if size == 1:
        return None
    return mesh[dims]._flatten("_".join(dims)) if len(dims) > 1 else mesh[dims[0]]


def build_schedule(plan: dict, parts, mesh, device: torch.device, loss_fn):
    """The plan's pipelining schedule over this rank's chunks (torch's class, by registry name)."""
    lay = plan["layout"]
    stages = [PipelineStage(part, i, lay["num_stages"], device, group=mesh["pp"].get_group()) for i, part in parts]
    cls = getattr(S, SCHEDULES[lay["schedule"]].torch_class)
    first = stages if issubclass(cls, S.PipelineScheduleMulti) else stages[0]
    return cls(first, n_microbatches=lay["microbatches"], loss_fn=loss_fn), stages


def sync_replicas(parts, reduce, copies: int) -> None:
    """Average every gradient (this rank's shard) across the copies of the model state, in one
    all-reduce (`reduce(flat)` sums in place): gloo has no AVG, so SUM and divide."""
    grads = []
    for _, part in parts:
        for p in part.parameters():
            if p.grad is not None:
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    flat /= copies
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

"""Apply the plan's parallelism to the model with PyTorch's native APIs.

- Tensor + sequence parallel: `parallelize_module` with Colwise/Rowwise/SequenceParallel
  (seed 2: one all-reduce per attention and per MLP block, as AG + RS with SP),
  a vocabulary-parallel embedding and a vocabulary-parallel loss (`loss_parallel`).
- Context parallel: the attention all-gathers K and V inside the CP group (model.py).
- FSDP2 (`fully_shard`) over data x context ranks, as torchtitan does; weights stay
  gathered between forward and backward under pipelining (the zero-bubble + FSDP2
  trap in ../shared/notes/torch-cpu.md).
- Pipeline: `torch.distributed.pipelining` stages cut from the plan's stage split,
  run by the configured schedule.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from orchestrator.plan.validate import stage_ids_of_rank, virtual_stages
from orchestrator.train.model import Transformer

SCHEDULES = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved_1f1b": S.ScheduleInterleaved1F1B,
    "zero_bubble": S.ScheduleInterleavedZeroBubble,
    "dualpipe": S.ScheduleDualPipeV,
}
MULTI_STAGE = {"interleaved_1f1b", "zero_bubble", "dualpipe"}


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


def build_model_parts(model_cfg, layout: dict, mesh, coords: dict, seed: int, loss_parallel: bool,
                      device: torch.device, mp: MixedPrecisionPolicy | None, recompute: str = "none"):
    """The model parts (virtual pipeline stages) this rank runs, parallelised, with stage ids."""
    pp, vp, schedule = layout["pp"], layout["vp"], layout["schedule"]
    torch.manual_seed(seed)  # every rank builds the same full model, then keeps its share
    full = Transformer(model_cfg)
    if pp == 1:
        parts = [(0, full)]
    else:
        n_chunks = vp if schedule in MULTI_STAGE else 1
        ranges = virtual_stages(layout["stage_layers"], n_chunks)
        ids = stage_ids_of_rank(coords["pp"], pp, n_chunks)
        last = pp * n_chunks - 1
        parts = [(i, copy.deepcopy(full).keep_only(*ranges[i], first=i == 0, last=i == last)) for i in ids]
        del full
    tp, cp, dp = layout["tp"], layout["cp"], layout["dp"]
    # FSDP shards over data x context ranks (ep is part of the data axis for dense weights).
    dp_mesh = mesh["dp", "ep", "cp"]._flatten("dp_cp") if dp * cp > 1 else None
    for _, part in parts:
        part.to(device)
        if tp > 1:
            apply_tp(part, mesh["tp"], loss_parallel)
        if cp > 1:
            apply_cp(part, mesh["cp"].get_group(), cp, coords["cp"])
        apply_recompute(part, recompute)
        if dp_mesh is not None:
            apply_fsdp(part, dp_mesh, reshard_after_forward=pp == 1, mp=mp)
    return parts


def build_schedule(parts, layout: dict, mesh, device: torch.device, loss_fn, microbatches: int):
    pp, schedule = layout["pp"], layout["schedule"]
    n_stages = pp * (layout["vp"] if schedule in MULTI_STAGE else 1)
    group = mesh["pp"].get_group()
    stages = [PipelineStage(part, i, n_stages, device, group=group) for i, part in parts]
    cls = SCHEDULES[schedule]
    if schedule in MULTI_STAGE:
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn), stages
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn), stages

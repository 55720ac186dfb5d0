"""Apply the plan's parallelism to the model with PyTorch's native APIs.

- Tensor + sequence parallel: `parallelize_module` with Colwise/Rowwise/SequenceParallel
  (Shoeybi et al. 2019, arXiv:1909.08053, section 3 and figure 3: one all-reduce per attention
  and per MLP block; as all-gather + reduce-scatter with SP: Korthikanti et al. 2022,
  arXiv:2205.05198, section 4.2.2),
  a vocabulary-parallel embedding and a vocabulary-parallel loss (`loss_parallel`).
- Context parallel: the attention all-gathers K and V inside the CP group (model.py).
- FSDP2 (`fully_shard`) over the ranks that shard one copy of the state (dps x cp), as
  torchtitan does; weights stay gathered between forward and backward under pipelining
  (torch 2.13's zero-bubble schedules, torch/distributed/pipelining/schedules.py, split
  the backward into input and weight parts; with FSDP2 resharding between them some gradients
  come out None or scaled; tests/test_runtime.py runs them against one process). With several copies
  (layout.dp_shard < dp: HSDP), `sync_replicas` averages the gradient shards across the
  copies over a group the runtime owns, so a lost copy can be dropped without touching
  FSDP's own groups.
- Pipeline: the stages are cut here exactly as plan.json lists them for this pipeline rank;
  pipeline.py runs them with the schedule class the registry names.

Everything layout-shaped comes from plan.json; nothing here re-derives it.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from orchestrator.rundir.plan import RunPlan
from orchestrator.train.model import Transformer
from orchestrator.train.moe import MoE, moe_layers


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
    if model.cfg.tied_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Both hold the weight sharded over the vocabulary (Shard(0)); parallelize_module made two.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if isinstance(block.feed_forward, MoE):
            # Routed experts see this rank's sequence shard (etp = 1); the router's weight is
            # replicated (its gradient summed over the shards); shared experts are a dense MLP.
            plan["feed_forward.router.gate"] = SequenceParallel(use_local_output=True)
            if block.feed_forward.shared is not None:
                plan.update(_mlp_plan("feed_forward.shared", block.feed_forward.shared))
        else:
            plan.update(_mlp_plan("feed_forward", block.feed_forward))
        parallelize_module(block, tp_mesh, plan)


def _mlp_plan(name: str, mlp) -> dict:
    """Megatron's MLP split: gather the sequence, column-parallel up (and gate), row-parallel down."""
    out = {name: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
           f"{name}.w1": ColwiseParallel(), f"{name}.w2": RowwiseParallel(output_layouts=Shard(1))}
    if hasattr(mlp, "w3"):
        out[f"{name}.w3"] = ColwiseParallel()
    return out


def apply_ep(model: Transformer, expert_mesh, ep: int, coords_ep: int) -> None:
    """Each EP rank keeps its experts' slice of the weights, as a DTensor sharded on the
    expert dimension over the plan's EP group (DCP then reshards across EP degrees)."""
    for _, moe in moe_layers([(0, model)]):
        if ep == 1:
            continue
        moe.ep, moe.ep_group = ep, expert_mesh["ep"].get_group()
        mine = moe.experts_total // ep
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            local = p.detach()[coords_ep * mine:(coords_ep + 1) * mine].clone()
            dt = DTensor.from_local(local, expert_mesh["ep"], [Shard(0)], run_check=False)
            setattr(moe.experts, name, nn.Parameter(dt))


def set_sequence_groups(model: Transformer, tp_group, cp_group, shards: int, aux_scale: float) -> None:
    """What the sequence-wise balance loss sums over (a sequence is split over TP with SP, and CP)."""
    for _, moe in moe_layers([(0, model)]):
        moe.tp_group, moe.cp_group, moe.seq_shards, moe.aux_scale = tp_group, cp_group, shards, aux_scale


def apply_cp(model: Transformer, group, cp: int, cp_rank: int) -> None:
    for block in model.layers.values():
        block.attention.cp_group, block.attention.cp, block.attention.cp_rank = group, cp, cp_rank


def apply_recompute(model: Transformer, mode: str, layers: int | None = None) -> None:
    """Activation checkpointing as the plan counts it: `full` keeps only each block's input
    and re-runs the block in backward (with `layers`, only the chunk's first that many blocks,
    Megatron's block method: the rest keep their activations); `selective` re-runs the norms,
    the attention core and the MLP activations (the cheap, activation-heavy parts).
    Checkpoint wrappers do not change the state-dict names the DCP helpers report."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(m):
        return checkpoint_wrapper(m, preserve_rng_state=False)

    for i, (key, block) in enumerate(list(model.layers.items())):
        if mode == "full":
            if layers is None or i < layers:
                model.layers[key] = wrap(block)
            continue
        block.attention_norm, block.ffn_norm = wrap(block.attention_norm), wrap(block.ffn_norm)
        block.attention.core = wrap(block.attention.core)
        ff = block.feed_forward
        for mlp in ([ff.experts] + ([ff.shared] if ff.shared is not None else [])) if isinstance(ff, MoE) else [ff]:
            mlp.act = wrap(mlp.act)


def apply_fsdp(model: Transformer, dp_mesh, reshard_after_forward: bool, mp: MixedPrecisionPolicy | None,
               expert_mesh=None) -> None:
    """Dense weights over the dense data-parallel group, experts over the expert one (edp).
    FSDP averages expert gradients over edp; the trainer rescales them to an average over
    dp x cp (train/moe.py ExpertSteps): FSDP's own divide factor needs PREMUL_SUM, which
    gloo lacks."""
    kw = {"reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = mp
    for block in model.layers.values():
        ignored = set()
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if isinstance(inner.feed_forward, MoE):
            experts = inner.feed_forward.experts
            if expert_mesh is not None:
                sharded = any(isinstance(p, DTensor) for p in experts.parameters())
                fully_shard(experts, mesh=expert_mesh, **kw,
                            shard_placement_fn=(lambda p: Shard(1)) if sharded else None)
            else:
                ignored = set(experts.parameters())  # reduced over EP by the all-to-all alone
        if dp_mesh is not None:
            fully_shard(block, mesh=dp_mesh, ignored_params=ignored or None, **kw)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh, ignored_params=_expert_params(model) if expert_mesh is None else None, **kw)


def _expert_params(model) -> set | None:
    out = {p for _, moe in moe_layers([(0, model)]) for p in moe.experts.parameters()}
    return out or None


def build_model_parts(plan: RunPlan, model_cfg, meshes: dict, coords: dict, seed: int, device: torch.device,
                      mp: MixedPrecisionPolicy | None, recompute: str = "none", recompute_layers: int | None = None):
    """The model chunks (virtual pipeline stages) this rank runs, parallelised: [(stage id, module)]."""
    lay, mesh = plan.layout, meshes["dense"]
    torch.manual_seed(seed)  # every rank builds the same full model, then keeps its share
    full = Transformer(model_cfg)
    if lay["pp"] == 1:
        parts = [(0, full)]
    else:
        mine = lay["stages"][coords["pp"]]["virtual"]
        parts = [(v["stage"], copy.deepcopy(full).keep_only(*v["layers"], first=v["first"], last=v["last"]))
                 for v in mine]
        del full
    fsdp = _flat(mesh, tuple(plan.mesh["fsdp"]))
    expert = meshes.get("expert")
    edp = expert["edp"] if expert is not None and expert["edp"].size() > 1 else None
    for _, part in parts:
        part.to(device)
        if expert is not None:
            apply_ep(part, expert, lay["ep"], expert.get_local_rank("ep"))
        if lay["tp"] > 1:
            apply_tp(part, mesh["tp"], loss_parallel=True)
        if lay["cp"] > 1:
            apply_cp(part, mesh["cp"].get_group(), lay["cp"], coords["cp"])
        set_sequence_groups(part, mesh["tp"].get_group() if lay["tp"] > 1 else None,
                            mesh["cp"].get_group() if lay["cp"] > 1 else None, lay["tp"] * lay["cp"],
                            aux_scale=1.0 if lay["pp"] > 1 else 1.0 / lay["microbatches"])
        apply_recompute(part, recompute, recompute_layers)
        # ZeRO-3 re-gathers the weights for backward, ZeRO-2 keeps them gathered from forward to
        # backward. Under pipelining they stay gathered whatever zero says (the plan counts it so):
        # the zero-bubble schedules give wrong gradients otherwise (see the module docstring).
        apply_fsdp(part, fsdp, reshard_after_forward=lay["zero"] == 3 and lay["pp"] == 1, mp=mp, expert_mesh=edp)
    return parts


def _flat(mesh, dims: tuple[str, ...]):
    """The sub-mesh over `dims` as one dimension (None when it has a single rank)."""
    size = 1
    for d in dims:
        size *= mesh[d].size()
    if size == 1:
        return None
    return mesh[dims]._flatten("_".join(dims)) if len(dims) > 1 else mesh[dims[0]]


def local_grads(parts) -> list[torch.Tensor]:
    """This rank's gradients (its shards), in the same order on every copy."""
    grads = []
    for _, part in parts:
        for p in part.parameters():
            if p.grad is not None:
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


def sync_replicas(parts, reduce, copies: int):
    """Sum every gradient (this rank's shard) across the copies of the model state, in one
    all-reduce (`reduce(flat)` sums in place) into a buffer of its own; the gradients themselves stay
    this copy's until the returned function writes the average back (gloo has no AVG: SUM, then
    divide), once the commit is granted. A step that re-forms instead keeps them local: the new
    generation adds only the lost copies' micro-batches to them (train/trainer.py)."""
    grads = local_grads(parts)
    if not grads:
        return lambda: None
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)

    def write_back() -> None:
        flat.div_(copies)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return write_back


@torch.no_grad()
def clip_grad_norm(parts, max_norm: float, pp_group=None) -> torch.Tensor:
    """The global L2 norm of the whole model's gradients, and every gradient scaled by
    min(1, max_norm / norm) (torch's clip_grads_with_norm_ rule, its 1e-6 included) when
    max_norm > 0. Global over every parallel dimension:
    - a DTensor gradient (FSDP2 shards, TP shards or replicas, EP's expert shards) takes its
      norm over its own mesh: torch's norm of a sharded DTensor is a partial value that
      `full_tensor()` reduces, a replicated dimension counts once. Gradients on different meshes
      (the dense one, the experts' edp x ep one) and plain ones (no parallelism on them) are
      normed apart and their squares added, as torchtitan's dist_utils.clip_grad_norm_ does for EP;
    - pipeline stages hold different layers: the squares are summed over the pipeline group
      (`pp_group`; torchtitan does the same: torch's clip_grad_norm_ knows nothing of stages);
    - copies of the state (HSDP across copies, train/replicas.py) hold the same averaged gradient
      once the trainer wrote the average back; each copy computes the same norm, nothing to add.
    Every rank of a mesh walks the same parameters in the same order, so the collectives line up
    (a parameter without a gradient, on every rank of its mesh alike, adds nothing). The norm
    comes back as a 0-d tensor on the gradients' device (no host sync here)."""
    groups: dict = {}  # mesh (None: plain tensors) -> gradients, in the order first seen
    for _, part in parts:
        for p in part.parameters():
            if p.requires_grad and p.grad is not None:
                g = p.grad
                groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    device = next((g.device for gs in groups.values() for g in gs), torch.device("cpu"))
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)  # one kernel per device and dtype
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += norm.to(device, torch.float32) ** 2
    if pp_group is not None:
        torch.distributed.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for grads in groups.values() for g in grads]
        for dev in {t.device for t in local}:
            torch._foreach_mul_([t for t in local if t.device == dev], coef.to(dev))
    return total


def keep_grads(parts, scale: float, holds: bool) -> None:
    """Before a recovery pass: every trainable parameter gets a gradient (zeros where this rank holds
    none: a copy new to the generation, so every copy's all-reduce buffer lines up), and the kept
    ones are rescaled to the new generation's weight (`scale`: new dp / old dp)."""
    for _, part in parts:
        for p in part.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None or not holds:
                p.grad = torch.zeros_like(p)
            elif scale != 1.0:
                p.grad.mul_(scale)

"""Mixture of experts as DeepSeek-V3 trains it (arXiv:2412.19437, Sec. 2.1.2 and 3.2).

- Router: affinity s = sigmoid(x W) (or softmax), top-k chosen on s + b where b is a
  per-expert bias that only steers the choice; the gate values are the chosen s,
  normalised to sum to 1 (sigmoid), times `route_scale`. Balance: auxiliary-loss-free
  (after each step b_i += speed x sign(mean load - load_i), loads counted over the whole
  global batch) and/or the sequence-wise auxiliary loss alpha x sum_i f_i P_i.
- Routed experts: one weight tensor per matrix, [experts, out, in], sharded over the
  expert-parallel group on dim 0 (a DTensor on the plan's expert mesh, so DCP reshards a
  checkpoint across EP degrees); tokens are dispatched to the experts' ranks and combined
  back with all-to-all (gloo on CPU, NCCL on GPUs).
- Shared experts: one dense MLP of width shared_experts x expert_ffn_hidden.

Under tensor parallelism the layer sees the sequence-parallel shard of each rank (no
expert TP: layout.etp = 1), so the tensor ranks are extra token sources of the EP group,
as in Megatron-Core with etp = 1. The router weight is replicated over TP, the shared
experts are tensor-parallel like a dense MLP.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from orchestrator.rundir.plan import RunPlan
from orchestrator.train.mlp import Activation, FeedForward, mlp_kind


class Traffic:
    """This process's all-to-all traffic since the last reset: bytes sent to other ranks
    (dispatch and combine, forward and backward) and the seconds spent in the calls.

    `uncounted()` covers forwards that are not training: torch's pipelining runs one on its
    first step to learn the stage shapes (on placeholder inputs past the first stage), and
    counting it would skew the expert load that steers the router bias."""

    def __init__(self):
        self.bytes, self.seconds = 0, 0.0
        self.counting = True

    @contextlib.contextmanager
    def uncounted(self):
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def reset(self) -> tuple[int, float]:
        out = (self.bytes, self.seconds)
        self.bytes, self.seconds = 0, 0.0
        return out


TRAFFIC = Traffic()


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if not TRAFFIC.counting:
        return out
    TRAFFIC.seconds += time.perf_counter() - t0
    me = dist.get_rank(group)
    row = math.prod(x.shape[1:]) * x.element_size()
    TRAFFIC.bytes += (sum(in_splits) - in_splits[me]) * row
    return out


class _AllToAll(torch.autograd.Function):
    """Token rows to their experts' ranks; backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _SumOverTensorRanks(torch.autograd.Function):
    """Sum over the sequence-parallel shards of the tensor group. The tensor ranks share one
    loss, so each takes only its own part of the gradient: backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverContextRanks(torch.autograd.Function):
    """Sum over the context-parallel shards. Each context rank has its own loss and the data
    ranks' gradients are averaged, so backward sums the copies' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AttachAuxLoss(torch.autograd.Function):
    """Adds an auxiliary loss to the backward pass through an activation (Megatron's
    MoEAuxLossAutoScaler): works inside pipeline stages, where only the last one has a loss."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside backward."""
    return torch._C._current_autograd_node() is not None


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, k: int, score: str, route_scale: float):
        super().__init__()
        self.k, self.score, self.route_scale = k, score, route_scale
        self.gate = nn.Linear(hidden, experts, bias=False)
        # Steers the top-k choice only (auxiliary-loss-free balancing); saved with the model.
        self.register_buffer("bias", torch.zeros(experts))

    def forward(self, x):
        logits = _local(self.gate(x)).float()
        scores = torch.sigmoid(logits) if self.score == "sigmoid" else torch.softmax(logits, dim=-1)
        idx = torch.topk(scores + self.bias, self.k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.route_scale, scores

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, speed: float) -> None:
        """DeepSeek-V3: lower the bias of overloaded experts, raise it for underloaded ones."""
        self.bias += speed * torch.sign(load.mean() - load).to(self.bias.dtype)


class GroupedExperts(nn.Module):
    """The routed experts' weights, [experts, out, in] per matrix (this rank's share under EP)."""

    def __init__(self, experts: int, hidden: int, ffn: int, mlp: str):
        super().__init__()
        self.mlp = mlp
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        if mlp == "swiglu":
            self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.act = Activation(mlp)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x holds each local expert's rows in turn (counts[e] of them)."""
        # (weights FSDP does not manage stay in fp32 under mixed precision)
        w1, w2 = _local(self.w1).to(x.dtype), _local(self.w2).to(x.dtype)
        w3 = _local(self.w3).to(x.dtype) if self.mlp == "swiglu" else None
        out, start = [], 0
        for e, n in enumerate(counts):  # every expert runs, even on no rows: all weights get a gradient
            xe = x[start:start + n]
            h = self.act(xe @ w1[e].t(), xe @ w3[e].t()) if w3 is not None else self.act(xe @ w1[e].t())
            out.append(h @ w2[e].t())
            start += n
        return torch.cat(out)


class MoE(nn.Module):
    """Router, routed experts and shared experts of one layer (the block's `feed_forward`)."""

    def __init__(self, cfg):
        super().__init__()
        moe, mlp = cfg.moe, mlp_kind(cfg)
        self.experts_total, self.k = moe.experts, moe.experts_per_token
        self.router = Router(cfg.hidden, moe.experts, moe.experts_per_token, moe.score.value, moe.route_scale)
        self.experts = GroupedExperts(moe.experts, cfg.hidden, moe.expert_ffn_hidden, mlp)
        self.shared = (FeedForward(cfg.hidden, moe.shared_experts * moe.expert_ffn_hidden, mlp)
                       if moe.shared_experts else None)
        self.aux_coef = moe.aux_loss_coef
        self.aux_scale = 1.0  # 1 / micro-batches when the loss is divided before backward
        # Set by the runtime from the plan's groups.
        self.ep, self.ep_group = 1, None
        self.tp_group, self.cp_group, self.seq_shards = None, None, 1
        self.register_buffer("tokens", torch.zeros(moe.experts, dtype=torch.float64), persistent=False)

    def forward(self, x):
        shared = self.shared(x) if self.shared is not None else None
        local = _local(x)
        b, s, h = local.shape
        idx, weights, scores = self.router(x)
        if TRAFFIC.counting and not recomputing():
            self.tokens += torch.bincount(idx.flatten(), minlength=self.experts_total).to(self.tokens.dtype)
        routed = self._routed(local.reshape(-1, h), idx.reshape(-1, self.k), weights.reshape(-1, self.k))
        routed = routed.view(b, s, h).to(local.dtype)
        if self.aux_coef > 0:
            routed = _AttachAuxLoss.apply(routed, self._aux_loss(idx, scores) * self.aux_scale)
        # Under TP the block's residual stream is the local sequence shard (as the dense MLP's
        # row-parallel output is), so both parts come back as local tensors.
        return routed if shared is None else routed + _local(shared)

    def _routed(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # every (token, choice) pair, grouped by expert
        rows = order // self.k
        xs = x[rows]
        counts = torch.bincount(flat, minlength=self.experts_total)
        if self.ep == 1:
            ys = self.experts(xs, counts.tolist())
        else:
            ys = self._dispatch_compute_combine(xs, counts)
        return torch.zeros_like(x, dtype=ys.dtype).index_add(0, rows, ys * weights.flatten()[order, None].to(ys.dtype))

    def _dispatch_compute_combine(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.experts_total // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # rows each source sends each of my experts
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        xr = _AllToAll.apply(xs, recv, send, self.ep_group)  # rows by (source rank, my expert)
        expert_of = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep), received.flatten())
        by_expert = torch.argsort(expert_of, stable=True)
        y = self.experts(xr[by_expert], received.sum(0).tolist())
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(len(by_expert), device=back.device)
        return _AllToAll.apply(y[back], send, recv, self.ep_group)

    def _aux_loss(self, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The sequence-wise balance loss (DeepSeek-V3 eq. 17-20), mean over the micro-batch's
        sequences; statistics summed over the sequence's shards (SP over TP, CP)."""
        e, k = self.experts_total, self.k
        share = scores / scores.sum(-1, keepdim=True)
        p = share.sum(1)  # [b, E]: this shard's part of sum_t s'_{i,t}
        f = F.one_hot(idx, e).sum((1, 2)).to(p.dtype)  # [b, E]: tokens routed to each expert
        if self.tp_group is not None:
            p = _SumOverTensorRanks.apply(p, self.tp_group)
            dist.all_reduce(f, group=self.tp_group)
        if self.cp_group is not None:
            p = _SumOverContextRanks.apply(p, self.cp_group)
            dist.all_reduce(f, group=self.cp_group)
        t = idx.shape[1] * self.seq_shards  # the whole sequence's tokens
        return self.aux_coef * ((e / (k * t)) * f * (p / t)).sum(-1).mean()



def moe_layers(parts) -> list[tuple[int, MoE]]:
    """(global layer index, MoE) for every MoE layer this rank holds."""
    out = []
    for _, part in parts:
        for key, block in part.layers.items():
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            if isinstance(inner.feed_forward, MoE):
                out.append((int(key), inner.feed_forward))
    return out


class ExpertSteps:
    """What the trainer does for the experts around each optimizer step: make their gradients
    an average over the data ranks (dp x cp) like every other gradient, count every expert's
    load over the whole global batch, apply the auxiliary-loss-free bias update, and report
    the load and the all-to-all traffic.

    An expert's gradient sums the tokens of every data rank of its EP group that routed to
    it; FSDP then averages it over edp (or nothing reduces it when edp = 1). Over the job that
    is the sum over all data ranks / edp, so it is scaled by edp / (dp x cp)."""

    def __init__(self, parts, plan: RunPlan):
        from torch.distributed.fsdp import FSDPModule

        m, lay = plan.config.model, plan.layout
        self.mods = moe_layers(parts)
        self.layers, self.experts, self.speed = m.layers, m.moe.experts, m.moe.bias_update_speed
        self.params = [(p, (lay["edp"] if isinstance(moe.experts, FSDPModule) else 1) / (lay["dp"] * lay["cp"]))
                       for _, moe in self.mods for p in moe.experts.parameters()]

    def scale_grads(self) -> None:
        for p, scale in self.params:
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)

    def after_step(self) -> dict:
        """Collective over the job. The step's load [layers, experts] (zeros for dense layers), and
        this rank's all-to-all bytes and seconds."""
        load = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        for i, m in self.mods:
            load[i] = m.tokens
            m.tokens.zero_()
        dist.all_reduce(load)
        if self.speed > 0:
            for i, m in self.mods:
                m.router.update_bias(load[i], self.speed)
        sent, seconds = TRAFFIC.reset()
        return {"load": load, "bytes": sent, "seconds": seconds}

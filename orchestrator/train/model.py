"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, a SwiGLU or
GeLU MLP, or after `model.moe.dense_layers` dense layers a mixture of experts (train/moe.py).

Module names are the same whatever the layout (`tok_embeddings`, `layers.<i>.attention.wq`,
`layers.<i>.feed_forward.w1`, `layers.<i>.feed_forward.experts.w1`, `norm`, `output`): they are the checkpoint's keys,
so a checkpoint written under one TP/PP split loads under another. Pipeline
stages are this model with the layers of other stages removed (`layers` is a
ModuleDict keyed by the global layer index).

Context parallelism (Llama 3's method): each CP rank holds 2 of the 2 x CP
sequence chunks (chunk r and 2CP-1-r, which balances causal work), computes
its queries locally and all-gathers keys and values inside the CP group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orchestrator.train.mlp import FeedForward, mlp_kind
from orchestrator.train.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens a CP rank holds: chunks r and 2cp-1-r of 2cp."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    a, b = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk), torch.arange(b * chunk, (b + 1) * chunk)])


def cp_shard(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of a [batch, seq, ...] tensor (load-balanced chunks)."""
    if cp == 1:
        return x
    return x.index_select(dim, cp_positions(x.shape[dim], cp, cp_rank).to(x.device))


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence inside the CP group; backward sums the gradients
    of every rank's copy and keeps this rank's slice (a reduce-scatter, built from an
    all-reduce because gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.len = dist.get_rank(group), x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.len:(ctx.rank + 1) * ctx.len], None


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on [batch, seq, heads, head_dim] at the given global positions."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(x.device, torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class AttentionCore(nn.Module):
    """softmax(q k^T) v with the causal (or CP) mask; no parameters, so selective recompute
    can checkpoint exactly this part."""

    def forward(self, q, k, v, mask=None):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hd = cfg.head_dim or cfg.hidden // cfg.heads
        self.heads, self.kv_heads, self.theta = cfg.heads, cfg.kv_heads, cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.heads * self.hd, cfg.hidden, bias=False)
        self.core = AttentionCore()
        self.cp_group = None  # set by the runtime when context parallelism is on
        self.cp = 1
        self.cp_rank = 0

    def forward(self, x):
        b, s, _ = x.shape
        # Local head counts follow from the local width, so the same code runs under TP.
        q = self.wq(x).view(b, s, -1, self.hd)
        k = self.wk(x).view(b, s, -1, self.hd)
        v = self.wv(x).view(b, s, -1, self.hd)
        full = s * self.cp
        qpos = cp_positions(full, self.cp, self.cp_rank)
        q, k = rope(q, qpos, self.theta), rope(k, qpos, self.theta)
        if self.cp > 1:
            k, v = _GatherSeq.apply(k, self.cp_group), _GatherSeq.apply(v, self.cp_group)
            kpos = torch.cat([cp_positions(full, self.cp, r) for r in range(self.cp)])
            mask = (kpos[None, :] <= qpos[:, None]).to(x.device)
        else:
            mask = None
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        o = self.core(q, k, v, mask)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg, index: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        if cfg.moe.experts and index >= cfg.moe.dense_layers:
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.hidden, cfg.ffn_hidden, mlp_kind(cfg))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (see `stage`)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.mla.kv_lora_rank:
            raise NotImplementedError(f"{cfg.name} uses multi-head latent attention, which the runtime does not have")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._init()

    def _init(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # matrices, and the experts' stacks of them
                out = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
                nn.init.normal_(p, mean=0.0, std=std / (2 * self.cfg.layers) ** 0.5 if out else std)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x

    def keep_only(self, start: int, end: int, first: bool, last: bool) -> "Transformer":
        """Turn this model into the stage holding layers [start, end)."""
        for i in list(self.layers.keys()):
            if not start <= int(i) < end:
                del self.layers[i]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None
        return self

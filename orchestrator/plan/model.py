"""Parameters, FLOPs and activation bytes of a decoder-only transformer, per layer.

Conventions (documented because every MFU figure depends on them):
- Model FLOPs per token are 6 * N (N = all parameters, embeddings included, the
  active ones for MoE; the seed's and PaLM's convention) plus, when
  `cost.attention_flops` is on, attention's own matmuls as a causal kernel runs
  them: forward s * heads * (d_qk + d_v) per token per layer, times 3 for
  forward + backward.
- Hardware FLOPs add what recomputation runs again: `full` one more forward of
  every layer, `selective` the attention core (and, under this runtime's and
  DeepSeek-V3's definition, MLA's up-projections; norms and the SwiGLU product are
  memory-bound work, costed in plan/kernels.py).
- Two meanings of "selective" (`stack.selective`): `attention_core` is Megatron's
  and Korthikanti et al.'s (2022): only the attention core is recomputed, so a layer
  keeps 34*s*b*h bytes with flash attention or not (the 5*a*s^2*b score bytes go);
  `orchestrator` (this runtime, DeepSeek-V3) also recomputes the norms, the MLP input
  and the SwiGLU product (and MLA's q, k, v from the latents), keeping 30-35% less.
- Activation bytes per token per layer are counted term by term from what
  autograd keeps (Korthikanti et al. 2022, Sec. 4): 34*h for a GPT layer with
  dropout and flash attention, which is the textbook figure. The textbook
  figure is pessimistic for Llama-style layers: there is no dropout (-2h of
  1-byte masks), grouped-query attention keeps K and V of kv_heads only (not
  4h), and SwiGLU keeps gate, up and their product (6f, not 4f + 2h). For
  Llama 3 405B that gives 31.75*h instead of 34*h, and Llama 3's published
  8K layout (no recompute, PP16) fits in 80 GiB only with the smaller figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate

from orchestrator.config.schema import Recompute, Selective


@dataclass(frozen=True)
class LayerShape:
    params: int  # all parameters of the layer
    expert_params: int  # the part that expert parallelism shards (routed experts)
    active_params: int  # parameters one token touches
    act_none: float  # activation bytes per token kept with no recompute (flash)
    act_selective: float  # ... with selective recompute (norms, attention core, SwiGLU product)
    act_selective_core: float  # ... with Megatron's selective recompute (the attention core only)
    recompute_up_flops: float  # MLA up-projection forward FLOPs per token (rebuilt under selective)
    attn_fwd_flops: float  # causal attention-core forward FLOPs per token / seq_len
    scores_bytes_per_s: float  # bytes per token per unit of seq_len without flash


@dataclass(frozen=True)
class LayerTable:
    """Prefix sums over layers (index i = layers [0, i)), for O(1) stage sums."""

    params: list[float]
    expert: list[float]
    model: list[float]
    hw: list[float]
    act: list[float]
    moe: list[int]
    act_none_per_layer: list[float]


def _prefix(xs) -> list:
    return [0] + list(accumulate(xs))


class ModelMath:
    """Shapes of one model; all quantities are per token unless named otherwise."""

    def __init__(self, m):
        self.m = m
        self.L = m.layers
        self.h = m.hidden
        self.V = m.vocab
        self.heads = m.heads
        self.kv = m.kv_heads
        self.hd = m.head_dim or (m.hidden // max(m.heads, 1))
        self.mla = m.mla if getattr(m, "mla", None) and m.mla.kv_lora_rank > 0 else None
        self.moe = m.moe if m.moe.experts > 0 else None
        self.dropout = 1 if m.dropout else 0

    # ---- attention -------------------------------------------------------------------
    @cached_property
    def qk_dim(self) -> int:
        return (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) if self.mla else self.hd

    @cached_property
    def v_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.hd

    @cached_property
    def attn_params(self) -> int:
        h, H = self.h, self.heads
        if self.mla:
            a = self.mla
            q = h * a.q_lora_rank + a.q_lora_rank * H * self.qk_dim if a.q_lora_rank else h * H * self.qk_dim
            kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim)
            return q + kv + H * self.v_dim * h
        return h * H * self.hd + 2 * h * self.kv * self.hd + H * self.hd * h

    def _attn_act(self, selective: bool) -> float:
        """Bytes per token kept by the attention block (bf16 = 2 bytes per element)."""
        h, H = self.h, self.heads
        norm_in = 2 * h  # RMSNorm/LayerNorm input
        qkv_in = 0 if selective else 2 * h  # the norm's output, recomputed under selective
        if self.mla:
            a = self.mla
            latents = 2 * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim)
            # DeepSeek's selective recompute rebuilds q, k, v from the latents.
            qkv = 0 if selective else 2 * H * (2 * self.qk_dim + self.v_dim)
            return norm_in + qkv_in + latents + qkv + 2 * H * self.v_dim + self.dropout * h
        q, kv = 2 * H * self.hd, 4 * self.kv * self.hd
        out = 2 * H * self.hd  # attention output = input of the output projection
        return norm_in + qkv_in + q + kv + out + self.dropout * h

    def _up_flops(self) -> float:
        if not self.mla:
            return 0.0
        a, H = self.mla, self.heads
        q = a.q_lora_rank * H * self.qk_dim if a.q_lora_rank else 0
        return 2.0 * (q + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim))

    # ---- MLP -------------------------------------------------------------------------
    def _mats(self) -> int:
        return 3 if self.m.mlp == "swiglu" else 2

    def _mlp_act(self, f: int, selective: bool) -> float:
        """Bytes per token kept by one MLP of width f, excluding its input."""
        if self.m.mlp == "swiglu":  # gate, up, and their product (recomputed under selective)
            return 4 * f + (0 if selective else 2 * f)
        return 2 * f + (0 if selective else 2 * f)  # pre-activation, activation output

    def layer(self, i: int) -> LayerShape:
        return self._layers[i]

    @cached_property
    def _layers(self) -> list[LayerShape]:
        # A layer's shape depends only on whether it is a mixture-of-experts layer: build each once.
        kinds: dict[bool, LayerShape] = {}
        out = []
        for i in range(self.L):
            moe = self.moe is not None and i >= self.moe.dense_layers
            if moe not in kinds:
                kinds[moe] = self._build_layer(i)
            out.append(kinds[moe])
        return out

    def _build_layer(self, i: int) -> LayerShape:
        h = self.h
        norms = 2 * h
        mats = self._mats()
        attn = self.attn_params
        moe_layer = self.moe is not None and i >= self.moe.dense_layers
        if moe_layer:
            e = self.moe
            per_expert = mats * h * e.expert_ffn_hidden
            routed = e.experts * per_expert
            shared = e.shared_experts * per_expert
            router = h * e.experts
            params = attn + routed + shared + router + norms
            active = attn + (e.experts_per_token + e.shared_experts) * per_expert + router + norms
            expert = routed
            mlp_act = lambda sel: (  # noqa: E731
                2 * h  # MLP input (the norm's output)
                + e.experts_per_token * (2 * h + self._mlp_act(e.expert_ffn_hidden, sel))  # dispatched copies
                + e.shared_experts * self._mlp_act(e.expert_ffn_hidden, sel)
                + 4 * e.experts  # router logits, fp32
            )
        else:
            f = self.m.ffn_hidden
            params = attn + mats * h * f + norms
            active, expert = params, 0
            mlp_act = lambda sel: (0 if sel else 2 * h) + self._mlp_act(f, sel) + self.dropout * h  # noqa: E731
        # Scores kept by a non-flash kernel: softmax (2 bytes) + dropout mask and output (1 + 2).
        scores = self.heads * (2 + 3 * self.dropout)
        return LayerShape(
            params=params,
            expert_params=expert,
            active_params=active,
            act_none=self._attn_act(False) + 2 * h + mlp_act(False),  # + 2h: the MLP norm's input
            act_selective=self._attn_act(True) + 2 * h + mlp_act(True),
            act_selective_core=self._attn_act(False) + 2 * h + mlp_act(False),
            recompute_up_flops=self._up_flops(),
            attn_fwd_flops=self.heads * (self.qk_dim + self.v_dim),
            scores_bytes_per_s=scores,
        )

    # ---- totals ----------------------------------------------------------------------
    @cached_property
    def embed_params(self) -> int:
        return self.V * self.h

    @cached_property
    def output_params(self) -> int:
        return 0 if self.m.tied_embeddings else self.V * self.h

    @cached_property
    def total_params(self) -> int:
        return sum(l.params for l in self._layers) + self.embed_params + self.output_params + self.h

    @cached_property
    def active_params(self) -> int:
        return sum(l.active_params for l in self._layers) + self.embed_params + self.output_params + self.h

    def model_flops_per_token(self, seq_len: int, attention: bool) -> float:
        """6N (+ causal attention) per token, forward and backward."""
        attn = sum(l.attn_fwd_flops for l in self._layers) * seq_len if attention else 0.0
        return 6.0 * self.active_params + 3.0 * attn

    def layer_flops(self, i: int, seq_len: int, attention: bool, recompute: str,
                    selective: str = "orchestrator") -> tuple[float, float]:
        """(model, hardware) FLOPs per token of layer i, forward + backward (+ recompute)."""
        l = self._layers[i]
        attn_fwd = l.attn_fwd_flops * seq_len if attention else 0.0
        model = 6.0 * l.active_params + 3.0 * attn_fwd
        if recompute == "full":
            hw = model + 2.0 * l.active_params + attn_fwd
        elif recompute == "selective":
            hw = model + attn_fwd + (l.recompute_up_flops if selective == "orchestrator" else 0.0)
        else:
            hw = model
        return model, hw

    def layer_act_bytes(self, i: int, seq_len: int, recompute: str, flash: bool,
                        selective: str = "orchestrator") -> float:
        """Activation bytes per token that layer i keeps for backward (before TP/CP division)."""
        l = self._layers[i]
        if recompute == "full":
            return 2.0 * self.h  # only the layer input
        scores = 0.0 if flash else l.scores_bytes_per_s * seq_len
        if recompute == "selective":  # either definition recomputes the score matrix
            return l.act_selective if selective == "orchestrator" else l.act_selective_core
        return l.act_none + scores

    def table(self, seq_len: int, recompute: Recompute, flash: bool, attention: bool,
              selective: Selective = Selective.orchestrator) -> LayerTable:
        return self._table(seq_len, recompute.value, flash, attention, selective.value)

    @lru_cache(maxsize=64)
    def _table(self, seq_len: int, recompute: str, flash: bool, attention: bool, selective: str) -> LayerTable:
        fl = [self.layer_flops(i, seq_len, attention, recompute, selective) for i in range(self.L)]
        return LayerTable(
            params=_prefix(l.params for l in self._layers),
            expert=_prefix(l.expert_params for l in self._layers),
            model=_prefix(f[0] for f in fl),
            hw=_prefix(f[1] for f in fl),
            act=_prefix(self.layer_act_bytes(i, seq_len, recompute, flash, selective) for i in range(self.L)),
            moe=_prefix(1 if l.expert_params else 0 for l in self._layers),
            act_none_per_layer=[self.layer_act_bytes(i, seq_len, "none", flash) for i in range(self.L)],
        )

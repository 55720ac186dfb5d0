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
- `every_other_matmul` is torchtitan's op-level selective AC (both 0.2 and 0.3: the block's
  forward re-runs in backward, each op's output taken from the saved ones where its policy
  saves it): the attention kernel and the odd-numbered matmuls of a block are saved (their
  outputs kept), every second matmul (block_matmuls, in the order the block runs them), the
  memory-bound ops and an MoE layer's router and routed experts (grouped GEMMs, in neither
  release's save list) run again.
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


# torchtitan's op-level selective AC, by Selective value: whether the block projects q, k, v in one matmul
OP_SAC = {"every_other_matmul": True, "every_other_matmul_split_qkv": False}


@dataclass(frozen=True)
class LayerShape:
    params: int  # all parameters of the layer
    expert_params: int  # the part that expert parallelism shards (routed experts)
    active_params: int  # parameters one token touches
    act_none: float  # activation bytes per token kept with no recompute (flash)
    act_selective: float  # ... with selective recompute (norms, attention core, SwiGLU product)
    act_selective_core: float  # ... with Megatron's selective recompute (the attention core only)
    recompute_up_flops: float  # MLA up-projection forward FLOPs per token (rebuilt under selective)
    # torchtitan's op-level selective AC (Selective.every_other_matmul*): forward FLOPs per token it runs
    # again and activation bytes per token it keeps, by the Selective value (block_matmuls)
    recompute_mm_flops: dict
    act_every_other: dict
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

    def block_matmuls(self, moe_layer: bool, fused_qkv: bool = True) -> list[tuple[int, int, str]]:
        """The matmuls one block runs forward through nn.Linear, in the order it runs them, as (in,
        out, tensor-parallel split: "col" shards the output, "row" the input, "" none), the order
        torchtitan's selective AC counts (torchtitan/models/llama3 and deepseek_v3 model.py, moe.py):
        attention's wq, wk, wv (0.2) or one fused wqkv (`fused_qkv`: 0.3's Llama 3), MLA's wq or wq_a,
        wq_b, then wkv_a, wkv_b; wo; the MLP's w1, w3, w2
        (GELU: w1, w2); an MoE layer runs its router (always recomputed, not counted) and its routed
        experts (grouped GEMMs, not matmuls) first, then its shared experts' w1, w3, w2."""
        h, H = self.h, self.heads
        out: list[tuple[int, int, str]] = []
        if self.mla:
            a = self.mla
            if a.q_lora_rank:
                out += [(h, a.q_lora_rank, ""), (a.q_lora_rank, H * self.qk_dim, "col")]
            else:
                out.append((h, H * self.qk_dim, "col"))
            out += [(h, a.kv_lora_rank + a.qk_rope_head_dim, ""),
                    (a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim), "col")]
        elif fused_qkv:
            out.append((h, (H + 2 * self.kv) * self.hd, "col"))
        else:
            out += [(h, H * self.hd, "col"), (h, self.kv * self.hd, "col"), (h, self.kv * self.hd, "col")]
        out.append((H * self.v_dim, h, "row"))
        if moe_layer:
            f = self.moe.shared_experts * self.moe.expert_ffn_hidden
        else:
            f = self.m.ffn_hidden
        if f:
            mlp = [(h, f, "col"), (h, f, "col"), (f, h, "row")] if self._mats() == 3 else [(h, f, "col"), (f, h, "row")]
            out += mlp
        return out

    def _every_other(self, moe_layer: bool, fused_qkv: bool) -> tuple[float, float]:
        """(forward FLOPs per token run again, activation bytes per token kept) under torchtitan's
        op-level selective AC: the even-numbered matmuls (2nd, 4th, ...) and, in an MoE layer, the
        router and the routed experts run again; the block's input, the odd-numbered matmuls'
        outputs, the attention output and MoE's all-to-all outputs (dispatch and combine, saved as
        communication) are kept: what torchtitan's own block keeps in eager (tests/test_step_bytes.py)."""
        mms = self.block_matmuls(moe_layer, fused_qkv)
        again = sum(2.0 * k * n for i, (k, n, _) in enumerate(mms) if i % 2 == 1)
        kept = 2.0 * self.h + sum(2.0 * n for i, (_, n, _) in enumerate(mms) if i % 2 == 0)
        # the attention kernel's outputs: its bf16 output and its fp32 log-sum-exp per head (flash
        # attention's backward takes both; tests/torchtitan_act_bytes.py counts them)
        kept += 2.0 * self.heads * self.v_dim + 4.0 * self.heads
        if moe_layer:
            e = self.moe
            again += 2.0 * self.h * e.experts + 2.0 * e.experts_per_token * self._mats() * self.h * e.expert_ffn_hidden
            kept += 2.0 * e.experts_per_token * 2.0 * self.h
        return again, kept

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
        sac = {v: self._every_other(moe_layer, fused) for v, fused in OP_SAC.items()}
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
            recompute_mm_flops={v: f for v, (f, _) in sac.items()},
            act_every_other={v: b for v, (_, b) in sac.items()},
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
        elif recompute == "selective" and selective in OP_SAC:
            hw = model + l.recompute_mm_flops[selective]  # the attention kernel is saved, not run again
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
        if recompute == "selective" and selective in OP_SAC:
            return l.act_every_other[selective]
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

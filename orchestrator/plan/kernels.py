"""Shape-aware kernel time: how long one micro-batch's arithmetic takes on one GPU.

The planner's first model ran every FLOP at one `hardware.kernel_efficiency`. Published
runs on the same GPU imply efficiencies from about 0.43 to 0.76, rising with the
per-GPU GEMM size and falling for small models; this module is the small physical
model that explains most of that (cost.kernel_model=shape, the default).

Per micro-batch, per layer, per GPU, with T = (seq_len / cp) x micro_batch tokens and
every GEMM (M, N, K) at the shape it has after tensor and expert parallelism:

    time =   sum_GEMMs 3 x max(2MNK / (peak x gemm_efficiency),       fwd, dgrad, wgrad: the
                           bytes(MK + KN + MN) / HBM)               roofline of each GEMM
                 (low-precision GEMMs, LOW_PRECISION: FP8, MXFP8 at peak_fp8, NVFP4 at
                  peak_fp4, x gemm_efficiency x fp8_gemm_efficiency, operands in their
                  bytes with block scales; NVFP4's wgrad inputs Hadamard-transformed)
           + elementwise x memory-bound bytes / HBM                   norms, residuals, rotary,
                                                                      activation, dropout, MoE
                                                                      permutes, FP8 casts, the
                                                                      loss (its kernels the stack's)
                                                                      (op by op in PyTorch eager:
                                                                      EAGER, stack.fused_elementwise)
           + (1 + 2.5 / 0.7) x attention-core forward FLOPs           flash attention (causal; its
               / (peak x attention_efficiency [x flash2_speed])         backward recomputes scores;
                                                                        FA2: stack.attention_kernel)
           + launch_overhead_us per kernel                            host time per launch: about
                                                                      20 kernels per layer, and
                                                                      per local expert its GEMMs
                                                                      (and FP8 casts)

Once a step, outside the micro-batches (step_features): the optimizer over the GPU's shard of its
state (AdamW, 28 bytes per parameter, and the gradient-norm clip where the run clips, 12 more:
Config.clip_norm) and what the stack's weight layout moves: Megatron's flat buffers zero the
gradients and refresh the bf16 weights from the fp32 master; FSDP2 copies each weight all-gather
out of its flat buffer and each reduce-scatter's gradients in (stack.gather_copy_out), all at the
memory-bound weight `elementwise`.

A GEMM is compute-bound when its intensity MNK / (MK + KN + MN) exceeds the GPU's
FLOP-per-byte balance (about 300 for an H100 in bf16, twice that in FP8): wide GEMMs (large
hidden / TP, many tokens) run at the ceiling, narrow ones (an expert that receives a
hundred tokens) at HBM speed. Memory-bound work grows with h while GEMM work grows with
h^2, and every kernel costs the host some microseconds however small it is, which is why
small models, thin tensor-parallel shards, short micro-batches and many small experts
reach less of the peak. Without flash attention (2021-22 Megatron) the attention core is
two batched GEMMs per head over the full (not causal) score matrix plus its softmax and
dropout traffic through HBM.

Seven numbers are fitted on published runs (orchestrator/published/calibrate.py): the GEMM
ceiling of each GPU generation (`hardware.gemm_efficiency`: Ampere, Hopper, Blackwell) and,
shared by every GPU, `cost.elementwise`, `cost.attention_efficiency`,
`cost.fp8_gemm_efficiency` and `cost.launch_overhead_us`. Recomputation adds the forward
work it re-runs. Element counts are per token, fwd + bwd, in 2-byte elements.

Not modelled, because it made runs nobody fitted worse (#37, benchmarks/calibration.py, leave
one source family out, 4.11 MFU points and 6.3% median throughput error without it): GEMM tile
and wave quantisation from the shapes and the SM count (128x256, 256x128 and 128x128 tiles, the
best of them; grouped over an MoE layer's local experts): with whole waves 4.40 points and 7.3%,
with an under-filled single wave only 4.15 and 6.4%, with edge padding only 4.15 and 6.4%.
A likely reason: cuBLAS's persistent and stream-K kernels balance the last wave, and the
fitted gemm_efficiency already carries the average loss. Nor a smooth roofline for the narrow
GEMMs near the GPU's balance point (compute and HBM time combined as (c^p + m^p)^(1/p) instead
of their max, so a GEMM at the ridge reaches less than either bound): against 4.04 points and
6.3% with the max, p = 1 gave 4.53 and 7.8%, p = 2 4.17 and 6.6%, p = 4 4.08 and 6.4%.
Nor fewer FP8 casts (Transformer Engine's fused cast-transpose: each GEMM input cast once, 2
elements moved per cast element, instead of the 2 per pass counted above): 4.35 points and 7.2%,
the fitted elementwise weight doubling (1.9) to put the memory-bound time back.
The attention speed (cost.attention_efficiency) is one fitted number for every stack and release,
and it is fitted where attention is most of the step: torchtitan's 2024-12 context-parallel runs
(32K-256K tokens, FlashAttention-2 at hardware.flash2_speed) are in the fit since 2026-12-05.
Without them the fit took it from runs where attention is a few percent of the step and put it at
0.63 of the bf16 peak (620 TFLOP/s forward on an H100, past every published kernel but FA3's), and
every attention-bound run came out fast: those rows 7-45%, Trainy's 8B 7.5%, NeMo's long-context
page 42% (median). Now 0.50 (about 500 TFLOP/s: 0.84 of cuDNN's published 595, as FA2 at 0.62 of
it runs at 0.84 of its own published 370: both kernels in training at the same fraction of their
benchmark), and the runs nobody fitted: Trainy 1.5%, DeepSeek-V3 5.9%, the long-context page 18%.
Not modelled, because no source here measures it: the attention kernel's speed per stack release.
NeMo 24.03.01's long-context runs (nemo_long_context, evaluation only) are still slower than
predicted, the same way on every row from 16K with no CP to 1M on CP32 (so not the CP ring, which
is planned as Megatron-Core runs it: stack.cp_comm=p2p): Transformer Engine 1.4's attention
(cuDNN fused attention on sm90, a 2024-03 cuDNN) ran slower than the 2025 releases the fit
describes, within the 20-50% Transformer Engine's own H100 benchmark puts between cuDNN and
FlashAttention-2 (docs/examples/attention/attention.ipynb, 2024-06). Ruled out on these rows:
recompute or offload forced by memory (the least recompute that fits is none, 21 to 52 of 80 GB),
CP sends the ring leaves exposed (the same excess at CP1). A per-release attention table (cuDNN
version x head dim x causal, forward and backward, measured on the GPU) is what would put it in
the model; the interval's release term (plan/uncertainty.py) covers it meanwhile.
Nor the backward at FlashAttention-3's measured rate instead of 0.7 of the forward's (H100, head
dim 128, 16K: cuDNN 516 against 595 TFLOP/s forward, FlashAttention-2 322 against 370, i.e. 0.87;
Shah et al. 2024, arXiv:2407.08608): attention_efficiency refits from 0.577 to 0.490 and the rest
barely moves (4.04 points and 6.3% either way; NeMo long-context 12.3% against 12.1%), so the 0.7
stays until a change in the recompute's weight shows in the rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from orchestrator.plan.model import OP_SAC, ModelMath
from orchestrator.plan.stages import buffer_grad_bytes, held, reduce_grad_bytes


@dataclass(frozen=True)
class Features:
    """Seconds of one micro-batch (GEMMs at their roofline; the rest at unit coefficients), summable."""

    gemm: float = 0.0  # GEMMs: the roofline, max(FLOPs at the ceiling, operand and result bytes / HBM)
    elem: float = 0.0  # memory-bound bytes / HBM bandwidth
    attn: float = 0.0  # flash-attention FLOPs as run (forward, backward, recompute) / bf16 peak
    kernels: float = 0.0  # kernel launches x 1e-6 (so its coefficient is in microseconds)

    def __add__(self, o: "Features") -> "Features":
        return Features(self.gemm + o.gemm, self.elem + o.elem, self.attn + o.attn, self.kernels + o.kernels)

    def scale(self, k: float) -> "Features":
        return Features(self.gemm * k, self.elem * k, self.attn * k, self.kernels * k)

    def as_tuple(self) -> tuple[float, ...]:
        return (self.gemm, self.elem, self.attn, self.kernels)


@dataclass(frozen=True)
class Coefficients:
    gemm_efficiency: float
    fp8: float
    elementwise: float
    attention_efficiency: float
    launch_overhead_us: float

    def seconds(self, f: Features) -> float:
        return (f.gemm + self.elementwise * f.elem + f.attn / self.attention_efficiency
                + self.launch_overhead_us * f.kernels)


def _clamp(x, lo: float, hi: float, default: float) -> float:
    """A fitted coefficient read defensively: the planner never raises on a hostile value."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return default
    return min(max(x, lo), hi) if math.isfinite(x) else default


def clock_fraction(hw) -> float:
    """The tensor cores' clock under a power cap, relative to the clock at TDP (which the fitted
    gemm_efficiency describes): dynamic power goes as C V^2 f and, over the DVFS range, the
    voltage with the clock, so power ~ f^3 and f ~ (cap / TDP)^(1/3) (static power left out: the
    slowdown is a lower bound). 1 with no cap, no TDP, or a cap at or above TDP."""
    cap, tdp = getattr(hw, "power_cap_w", None), getattr(hw, "tdp_w", None)
    if cap is None or tdp is None:
        return 1.0
    share = _clamp(cap, 1.0, 1e5, 1e5) / _clamp(tdp, 1.0, 1e5, 1e5)
    return min(share, 1.0) ** (1.0 / 3.0)


def coefficients(hw, cost) -> Coefficients:
    return Coefficients(
        gemm_efficiency=_clamp(getattr(hw, "gemm_efficiency", 0.75), 1e-3, 1.0, 0.75),
        fp8=_clamp(getattr(cost, "fp8_gemm_efficiency", 0.7), 1e-3, 1.0, 0.7),
        elementwise=_clamp(getattr(cost, "elementwise", 1.0), 0.0, 100.0, 1.0),
        attention_efficiency=_clamp(getattr(cost, "attention_efficiency", 0.5), 1e-3, 1.0, 0.5),
        launch_overhead_us=_clamp(getattr(hw, "launch_overhead_us", None) if getattr(hw, "launch_overhead_us", None)
                                  is not None else getattr(cost, "launch_overhead_us", 0.0), 0.0, 1e5, 0.0),
    )


@dataclass(frozen=True)
class LowPrecision:
    """A low-precision GEMM format as the stacks run it: bytes per operand element with its scales,
    the tensor-core peak it runs at, and whether the wgrad inputs go through a Hadamard transform."""

    operand_bytes: float
    peak: str  # "fp8" | "fp4"
    hadamard: bool = False


LOW_PRECISION = {
    # per-tensor scales (Transformer Engine's delayed/current scaling; DeepSeek-V3's 1x128 tiles, 1/128 B)
    "fp8": LowPrecision(1.0, "fp8"),
    # OCP Microscaling: an E8M0 scale per 32 elements (Transformer Engine's MXFP8 recipe, Blackwell)
    "mxfp8": LowPrecision(1.0 + 1.0 / 32, "fp8"),
    # E2M1 with an E4M3 scale per 16 elements (and one FP32 per tensor); the recipe (arXiv:2509.25149)
    # runs fprop, dgrad and wgrad in FP4 and passes wgrad's two inputs through a 16x16 random
    # Hadamard transform first (memory-bound here: read and write of both)
    "nvfp4": LowPrecision(0.5 + 1.0 / 16, "fp4", hadamard=True),
}


def fp4_peak(hw) -> float:
    """Dense FP4 peak (Blackwell), never above four times the bf16 peak; 0 where the GPU has none."""
    v = getattr(hw, "peak_fp4_tflops", None)
    p = _clamp(v, 1e-6, 1e7, 0.0) if v is not None else 0.0
    return min(p, 4.0 * hw.peak_tflops) if p > 0 else 0.0


def fp8_peak(hw) -> float:
    """Dense FP8 peak: the preset's, never above twice the bf16 peak (tensor cores double it)."""
    v = getattr(hw, "peak_fp8_tflops", None)
    p = _clamp(v, 1e-6, 1e7, 0.0) if v is not None else 0.0
    return min(p, 2.0 * hw.peak_tflops) if p > 0 else 2.0 * hw.peak_tflops


@dataclass(frozen=True)
class Shape:
    """Everything the per-layer work depends on (hashable: the per-layer cache key)."""

    t: int  # tensor parallel
    etp: int
    ep: int
    seq: int  # full sequence length (attention span)
    tokens: float  # tokens per GPU per micro-batch: seq / cp x micro_batch
    mb: int  # sequences per micro-batch
    lowp: str  # "" (bf16) or a LOW_PRECISION format the linear layers' GEMMs run in
    flash: bool
    recompute: str  # none | selective | full
    selective: str  # orchestrator | attention_core
    sp: bool
    imbalance: float
    peak16: float  # FLOP/s
    gemm16: float  # FLOP/s a bf16 GEMM reaches: peak x gemm_efficiency
    gemm8: float  # ... a low-precision GEMM: its format's peak x gemm_efficiency x fp8_gemm_efficiency
    hbm: float  # bytes/s
    eager: bool = False  # memory-bound ops run op by op (stack.fused_elementwise=false)
    attn_speed: float = 1.0  # the attention kernel's speed relative to the fitted fused kernels
    bf16_share: float = 0.0  # of the layers, those a low-precision run keeps in BF16 (training.bf16_layers)
    sp_relayout: bool = False  # TP collectives re-lay whole activations (stack.activation_layout; sp_copies)
    loss: str = "torch"  # the loss's kernels (stack.cross_entropy; LOSSES)


def _gemm(M: float, N: float, K: float, lowp: bool, shape: Shape, passes: float = 3.0) -> Features:
    """fwd + dgrad + wgrad of one GEMM (passes = 3), or its forward alone (passes = 1)."""
    if M <= 0 or N <= 0 or K <= 0:
        return Features()
    flops = passes * 2.0 * M * N * K
    fmt = LOW_PRECISION[shape.lowp] if lowp else None
    b_in = fmt.operand_bytes if fmt else 2.0
    nbytes = passes * (b_in * (M * K + K * N) + 2.0 * M * N)
    casts = passes * 2.0 * (M * K + M * N) if fmt else 0.0  # quantise inputs and gradients (elements)
    launches = passes * (3.0 if fmt else 1.0) * 1e-6  # the GEMM, and two casts per low-precision GEMM
    if fmt and fmt.hadamard and passes >= 3:  # wgrad's inputs (activations M x K, gradients M x N)
        casts += 2.0 * (M * K + M * N)
        launches += 2e-6
    seconds = max(flops / (shape.gemm8 if fmt else shape.gemm16), nbytes / shape.hbm)
    return Features(gemm=seconds, elem=2.0 * casts / shape.hbm, kernels=launches)


def _elem(elements: float, shape: Shape) -> Features:
    return Features(elem=2.0 * elements / shape.hbm)


# PyTorch eager (stack.fused_elementwise=false) runs each memory-bound op as its own kernels,
# every intermediate through HBM; a fused kernel (Transformer Engine, Apex, torch.compile's
# Inductor) reads its inputs and writes its outputs once. Extra elements moved per element of
# the op's output, forward + backward, in 2-byte units (an fp32 tensor counts 2), from the ops
# eager autograd runs (pytorch/pytorch@1963fc8, the torch torchtitan's 2024-12 benchmarks ran):
# - RMSNorm, torch's composite rms_norm (x.float(), pow, mean, rsqrt, mul, type_as, mul weight):
#   forward 18 against 2 fused, backward 33 against 3 -> 46 more. LayerNorm has a native
#   kernel in eager (aten native_layer_norm), so GELU models (GPT, LayerNorm) pay none.
# - SwiGLU, silu(x W1) * (x W3) as two ops: forward 5, backward 9 per output element against
#   the fused 8 -> 6 more.
# - rotary embedding as torchtitan writes it (float, view_as_complex, mul, view_as_real,
#   type_as): forward and backward 10 each against the fused 4 -> 16 more per rotated element
#   (4 x the fused count).
# Bytes / HBM bandwidth, as the fused work (hardware.hbm_gbps: the GPU's datasheet figure).
# (The loss is its own table, LOSSES: which kernels run it is the stack's stack.cross_entropy.)
EAGER = {"rmsnorm": 46.0, "swiglu": 6.0, "rope": 4.0}

# The loss over the vocabulary, by the implementation the stack runs (stack.cross_entropy), from the
# output layer's bf16 logits to the bf16 gradient its backward takes: the logit-sized elements moved
# per logit, forward + backward, in 2-byte units (an fp32 tensor counts 2), and the most logit-sized
# memory alive at once, bytes per logit (the inventory's last stage). Counted on each one's own code
# by tests/loss_bytes.py (tests/test_step_bytes.py), but for te:
# - torch: F.cross_entropy(logits.float()) in eager (torchtitan, this runtime): the cast (1 read, 2
#   written), log_softmax (2, 2), nll_loss's backward writing the one-hot gradient (2),
#   log_softmax's backward (4, 2) and the cast back (2, 1): 18; the fp32 log-probabilities saved for
#   backward, the one-hot and log_softmax's fp32 gradient at once: 12 bytes.
# - inductor: the same through torch.compile (torchtitan compiles the loss since 2025: its
#   components/loss.py): one fused kernel each way, Inductor's own count of what its fused nodes read
#   and write: 4; it saves the bf16 logits for backward, which writes the bf16 gradient: 4 bytes.
# - megatron: Megatron-Core's vocab_parallel_cross_entropy (tensor_parallel/cross_entropy.py; the
#   default, --cross-entropy-loss-fusion off): cast to fp32, max, in-place subtract, exp, sum and
#   divide forward (19), the in-place multiply by the loss's gradient and autograd's cast back to the
#   logits' bf16 backward (7): 26; the fp32 softmax beside the bf16 logits, then the gradient: 6 bytes.
# - megatron_fused: the same algorithm in four jit-fused regions (fusions/fused_cross_entropy.py,
#   cross_entropy_loss_fusion with the native impl), each reading its inputs and writing its outputs
#   once: 14; 6 bytes.
# - te: Transformer Engine's Triton kernels (pytorch/triton/cross_entropy.py, cross_entropy_fusion_impl
#   "te", Megatron-Bridge's performance recipes): an online-softmax pass and a loss pass that read the
#   bf16 logits and write the fp32 gradient (4), backward an in-place multiply by the per-token loss
#   gradient (4) and autograd's cast to bf16 (3): 11; the fp32 gradient beside the logits: 6 bytes.
#   Read from its code (Triton does not run here).
# - torch_parallel: torch's cross_entropy where TP > 1 (torchtitan's and this runtime's loss_parallel:
#   logits sharded over the vocabulary, torch.distributed.tensor.parallel.loss): its _log_softmax
#   subtracts the all-reduced max, exponentiates, subtracts the all-reduced log-sum (cast, amax, sub,
#   exp, sub: 2 fp32 tensors at once beside the fp32 input and the bf16 logits), and its fused nll and
#   log_softmax backward builds a zeroed one-hot and returns (one_hot + exp(log-probs)) x grad: 42; the
#   saved log-probabilities, the one-hot, the exp and their sum at once: 16 bytes.
@dataclass(frozen=True)
class Loss:
    elements: float  # moved per logit, fwd + bwd, 2-byte units
    peak_bytes: float  # logit-sized memory alive at once, bytes per logit


LOSSES = {"torch": Loss(18.0, 12.0), "inductor": Loss(4.0, 4.0), "megatron": Loss(26.0, 6.0),
          "megatron_fused": Loss(14.0, 6.0), "te": Loss(11.0, 6.0), "torch_parallel": Loss(42.0, 16.0)}


def loss_kernels(cross_entropy: str, tp: int) -> str:
    """The LOSSES entry a stack's loss runs (stack.cross_entropy): torch's eager cross_entropy under
    tensor parallelism is loss_parallel's (torchtitan and this runtime shard the logits over the
    vocabulary wherever TP > 1)."""
    return "torch_parallel" if cross_entropy == "torch" and tp > 1 else cross_entropy


@lru_cache(maxsize=4096)
def layer_features(mm: ModelMath, moe: bool, s: Shape) -> Features:
    """One layer, one micro-batch, one GPU."""
    h, H, t, T = mm.h, mm.heads, s.t, s.tokens
    f8 = bool(s.lowp)
    seq_shard = t if s.sp else 1  # sequence parallelism shards the norms' and residuals' tokens
    full = s.recompute == "full"
    # torchtitan's op-level selective AC: the block's forward runs again but for the saved ops (the
    # attention kernel, the odd-numbered matmuls): every second matmul, the memory-bound ops, MoE's
    # router and routed experts (ModelMath.block_matmuls)
    op_sac = s.recompute == "selective" and s.selective in OP_SAC
    rerun = full or op_sac  # the memory-bound forward and its launches run again
    # Launches besides the GEMMs: norms, rotary, attention, activation, residuals (16 forward and
    # backward), TP/SP collectives (8), a forward run again under full recompute.
    out = Features(kernels=(16.0 + (8.0 if t > 1 else 0.0)) * (4.0 / 3.0 if rerun else 1.0) * 1e-6)
    if op_sac:
        for i, (k_in, n_out, split) in enumerate(mm.block_matmuls(moe, OP_SAC[s.selective])):
            if i % 2 == 1:
                out += _gemm(T, n_out / t if split == "col" else n_out, k_in / t if split == "row" else k_in, f8, s,
                             1.0)
    # ---- attention projections ------------------------------------------------------------------
    proj: list[tuple[float, float, float]] = []
    if mm.mla:
        a = mm.mla
        if a.q_lora_rank:
            proj += [(T, a.q_lora_rank, h), (T, H * mm.qk_dim / t, a.q_lora_rank)]
        else:
            proj.append((T, H * mm.qk_dim / t, h))
        proj += [(T, a.kv_lora_rank + a.qk_rope_head_dim, h),
                 (T, H * (a.qk_nope_head_dim + a.v_head_dim) / t, a.kv_lora_rank), (T, h, H * mm.v_dim / t)]
        up = [(T, H * mm.qk_dim / t, a.q_lora_rank)] if a.q_lora_rank else []
        up.append((T, H * (a.qk_nope_head_dim + a.v_head_dim) / t, a.kv_lora_rank))
        rope = 4.0 * (H / t + 1) * a.qk_rope_head_dim
    else:
        kv_local = mm.kv / t if mm.kv % t == 0 else 1.0
        proj += [(T, (H / t + 2 * kv_local) * mm.hd, h), (T, h, H * mm.hd / t)]
        up = []
        rope = 4.0 * (H / t + kv_local) * mm.hd
    for M, N, K in proj:
        out += _gemm(M, N, K, f8, s, 4.0 if full else 3.0)
    # ---- attention core -------------------------------------------------------------------------
    recompute_core = s.recompute == "full" or (s.recompute == "selective" and not op_sac)
    if s.flash:
        fwd = T * H / t * (mm.qk_dim + mm.v_dim) * s.seq  # causal: half of the full score matrix
        # attention_efficiency is the forward's. Flash attention's backward recomputes the scores,
        # 2.5 forwards' FLOPs at about 0.7 of the forward's rate (FlashAttention-2, Dao 2023), so
        # a step costs 1 + 2.5 / 0.7 forwards (one more when recompute runs the core again).
        out += Features(attn=(1.0 + 2.5 / 0.7 + (1.0 if recompute_core else 0.0)) * fwd / (s.peak16 * s.attn_speed))
    else:  # QK^T and AV per head over the full score matrix (2021-22 Megatron computes it all)
        q_len = T / max(s.mb, 1)
        passes = 4.0 if recompute_core else 3.0
        heads = s.mb * H / t
        g = (_gemm(q_len, s.seq, mm.qk_dim, False, s, passes)
             + _gemm(q_len, mm.v_dim, s.seq, False, s, passes))
        out += replace(g.scale(heads), kernels=g.kernels)  # batched over heads: one launch each
    # ---- MLP ------------------------------------------------------------------------------------
    mats = 3 if mm.m.mlp == "swiglu" else 2
    act = 8.0 if mats == 3 else 5.0  # activation's elements per output element, fwd + bwd (_mlp)

    def mlp(tokens: float, f: float, shard: int, count: float = 1.0,
            passes: float | None = None) -> tuple[Features, float]:
        return _mlp(mm, s, tokens, f, shard, count, passes)

    if moe and mm.moe:
        e = mm.moe
        owned = T / seq_shard  # tokens this rank routes
        out += _gemm(owned, e.experts, h, False, s, 4.0 if full else 3.0)  # router, kept in bf16
        act_elems = 0.0
        if e.shared_experts:
            g, a_el = mlp(T, e.shared_experts * e.expert_ffn_hidden, t)
            out += g
            act_elems += a_el
        g, a_el = _routed_experts(mm, s)
        out += g
        if op_sac:  # the router and the routed experts' grouped GEMMs run again
            out += _gemm(owned, e.experts, h, False, s, 1.0)
            out += _routed_experts(mm, s, passes=1.0)[0]
        act_elems += a_el
        copies = _routed_copies(mm, s)
        elems = act_elems + 8.0 * copies * h + 4.0 * owned * e.experts  # permute/unpermute, router softmax
        out += Features(kernels=24.0e-6)  # router softmax/top-k/aux loss, permutes, all-to-all, sorts
    else:
        g, act_elems = mlp(T, mm.m.ffn_hidden, t)
        out += g
        elems = act_elems
    # ---- memory-bound work ----------------------------------------------------------------------
    elems += 16.0 * T * h / seq_shard  # two norms (fwd 2h, bwd 3h) and two residual adds
    elems += rope * T
    elems += 10.0 * mm.dropout * T * h / seq_shard  # dropout masks and their application
    if s.eager:
        elems += EAGER["rope"] * rope * T
        if mats == 3:  # SwiGLU models (Llama) norm with RMSNorm
            elems += EAGER["rmsnorm"] * 2 * T * h / seq_shard + EAGER["swiglu"] / act * act_elems
    if rerun:
        elems *= 1.4  # the forward's share of the memory-bound work, run again
    if s.sp_relayout and t > 1:
        elems += sp_copies(s.mb, op_sac, full) * 2.0 * T * h  # each read and written once
    elif s.recompute == "selective" and s.selective == "orchestrator":
        # This runtime's (and DeepSeek-V3's) selective recompute: norms, the SwiGLU product and
        # MLA's up-projections run again in backward.
        elems += 4.0 * T * h / seq_shard + (3.0 / 8.0 * act_elems if mats == 3 else 0.0)
        for M, N, K in up:
            out += _gemm(M, N, K, f8, s, 1.0)
    out += _elem(elems, s)
    return out


def _mlp(mm: ModelMath, s: Shape, tokens: float, f: float, shard: int, count: float = 1.0,
         passes: float | None = None) -> tuple[Features, float]:
    """An MLP's GEMMs (fwd, dgrad, wgrad; a forward more under full recompute, or `passes`) and its
    activation's elements (8 per output element forward and backward for SwiGLU, 5 for GELU)."""
    swiglu = mm.m.mlp == "swiglu"
    n = passes if passes is not None else (4.0 if s.recompute == "full" else 3.0)
    up_n = (2 if swiglu else 1) * f / shard
    f8 = bool(s.lowp)
    g = _gemm(tokens, up_n, mm.h, f8, s, n) + _gemm(tokens, mm.h, f / shard, f8, s, n)
    return g.scale(count), (8.0 if swiglu else 5.0) * tokens * f / shard * count


def _routed_experts(mm: ModelMath, s: Shape, passes: float | None = None) -> tuple[Features, float]:
    """One MoE layer's routed experts on one GPU: their grouped GEMMs and activation elements."""
    e = mm.moe
    per_expert = s.ep * (s.tokens * s.etp / s.t) * e.experts_per_token / e.experts * (1.0 + s.imbalance)
    return _mlp(mm, s, per_expert, e.expert_ffn_hidden, s.etp, count=e.experts / s.ep, passes=passes)


def _routed_copies(mm: ModelMath, s: Shape) -> float:
    """The routed copies of the tokens this rank routes (what the dispatcher permutes)."""
    return s.tokens / (s.t if s.sp else 1) * mm.moe.experts_per_token * (1.0 + s.imbalance)


# A MoE layer as Megatron-Core's combined 1F1B runs it (stack.ep_overlap; model_chunk_schedule_plan.py
# TransformerLayerSchedulePlan): two modules on the compute stream, "pre_dispatch_computation" (norms,
# attention, router, shared experts, the dispatcher's permute) and "mlp" (the routed experts between the
# dispatcher's post-dispatch and pre-combine sorts), each run as forward, backward's input gradients (dgrad)
# and, with --delay-wgrad-compute, its weight gradients (wgrad) apart. The features' shares per pass: a
# GEMM's three passes are one each (_gemm); flash attention's forward is 1 of 1 + 2.5 / 0.7 (+1 when
# recompute runs the core again, in backward) forwards' time and has no weights; the memory-bound work 2
# of 5 elements forward (a norm: fwd 2h, bwd 3h); the launches a third each.
def _passes(f: Features, coef: Coefficients, core_again: bool) -> tuple[float, float, float]:
    attn_fwd = 1.0 / (1.0 + 2.5 / 0.7 + (1.0 if core_again else 0.0))
    gemm, elem = f.gemm, coef.elementwise * f.elem
    attn, kern = f.attn / coef.attention_efficiency, coef.launch_overhead_us * f.kernels
    return (gemm / 3 + attn * attn_fwd + 0.4 * elem + kern / 3,
            gemm / 3 + attn * (1.0 - attn_fwd) + 0.6 * elem + kern / 3,
            gemm / 3 + kern / 3)


def moe_modules(mm: ModelMath, s: Shape, coef: Coefficients) -> tuple[tuple[float, float, float],
                                                                    tuple[float, float, float]]:
    """Seconds of one MoE layer's (forward, dgrad, wgrad) in its attention-side module and in its
    routed experts, at the kernel model's speed; together they are layer_features(mm, True, s)."""
    g, a_el = _routed_experts(mm, s)
    # half the permutes (8 elements per copy and hidden element: four passes of the copies forward and
    # backward): the sorts around the grouped GEMMs run in the experts' node
    experts = g + _elem(a_el + 4.0 * _routed_copies(mm, s) * mm.h, s) + Features(kernels=12.0e-6)
    rest = layer_features(mm, True, s) + experts.scale(-1.0)
    core_again = s.recompute == "full" or (s.recompute == "selective" and s.selective not in OP_SAC)
    return _passes(rest, coef, core_again), _passes(experts, coef, False)


def sp_copies(mb: int, op_sac: bool, full: bool) -> float:
    """Whole-activation copies per layer and micro-batch that torch's sequence-parallel collectives
    make on [b, s, h] activations (stack.activation_layout=bsh): NCCL gathers and scatters along
    dim 0, so an all-gather on the sequence dim re-lays its output (a copy unless the micro-batch is
    one sequence: torch._utils._maybe_view_chunk_cat) and a reduce-scatter its input (always:
    _chunk_or_narrow_cat). A layer runs two of each forward (attention's and the MLP's input gathered,
    their outputs reduce-scattered) and two of each backward (each the other's gradient); torchtitan's
    selective AC runs the two all-gathers again, full recompute all four."""
    gathers = 4.0 + (2.0 if op_sac or full else 0.0)
    scatters = 4.0 + (2.0 if full else 0.0)
    return (gathers if mb > 1 else 0.0) + scatters


def output_features(mm: ModelMath, s: Shape) -> Features:
    """The output layer (kept in bf16 by FP8 recipes) and the loss on the last stage, its kernels the
    stack's (LOSSES)."""
    V = mm.V / s.t
    g = _gemm(s.tokens, V, mm.h, False, s)
    return g + _elem(LOSSES[s.loss].elements * s.tokens * V, s)


def shape_of(d, tr, hw, spec, coef: Coefficients | None = None) -> Shape:
    stack, moe = spec.stack, spec.model.moe
    coef = coef or coefficients(hw, spec.cost)
    clock = clock_fraction(hw)  # tensor-core work runs at the capped clock; memory-bound work does not
    return Shape(
        t=d.tp, etp=d.etp, ep=d.ep, seq=tr.seq_len, tokens=tr.seq_len / d.cp * tr.micro_batch,
        mb=tr.micro_batch,
        lowp=tr.precision.value if tr.precision.value in LOW_PRECISION else "", flash=bool(tr.flash_attention),
        recompute=tr.recompute.value,
        selective=stack.selective.value, sp=bool(spec.layout.sequence_parallel),
        imbalance=_clamp(getattr(moe, "load_imbalance", 0.0), 0.0, 100.0, 0.0),
        peak16=hw.peak_tflops * 1e12 * clock, gemm16=hw.peak_tflops * 1e12 * coef.gemm_efficiency * clock,
        gemm8=low_precision_peak(hw, tr.precision.value) * 1e12 * coef.gemm_efficiency * coef.fp8 * clock,
        hbm=hw.hbm_gbps * 1e9, bf16_share=min(max(tr.bf16_layers, 0) / max(spec.model.layers, 1), 1.0)
        if tr.precision.value in LOW_PRECISION else 0.0,
        eager=not stack.fused_elementwise,
        sp_relayout=(stack.activation_layout.value == "bsh" and d.tp > 1
                   and bool(spec.layout.sequence_parallel) and not stack.tp_overlap > 0
                   and hw.device.value != "cpu"),  # on a CPU the probe's per-call time holds them
        loss=loss_kernels(stack.cross_entropy.value, d.tp),
        attn_speed=(_clamp(hw.flash2_speed, 1e-3, 1.0, 1.0)
                    if stack.attention_kernel.value == "flash2" else 1.0))


def low_precision_peak(hw, precision: str) -> float:
    """Dense TFLOP/s of the format's GEMMs (FP8's for bf16 runs: unused)."""
    fmt = LOW_PRECISION.get(precision)
    return fp4_peak(hw) if fmt is not None and fmt.peak == "fp4" else fp8_peak(hw)


# Once per step, per GPU, memory-bound (bytes per parameter; fp32 optimizer state and gradients).
# AdamW in one fused pass (torch's _fused_adamw_, Megatron's fused Adam): reads the parameter, its
# gradient and both moments, writes all but the gradient (the CUDA kernel stores the gradient back
# only under a grad scaler: aten/src/ATen/native/cuda/fused_adam_utils.cuh, `i != kGradIdx ||
# grad_scale_ptr`). torch's foreach AdamW instead makes eight passes, 20 accesses an element
# (torch/optim/adam.py _multi_tensor_adam), which no stack here runs: torchtitan's default
# implementation is "fused", this runtime asks for it on a GPU. tests/test_step_bytes.py counts both.
ADAMW_BYTES = 28.0
# foreach clip_grad_norm_: _foreach_norm reads every gradient, _foreach_mul_ scales it (read, write)
# (torch/nn/utils/clip_grad.py _get_total_norm, _clip_grads_with_norm_)
CLIP_BYTES = 12.0
MASTER_COPY_BYTES = 6.0  # the fp32 master read, the bf16 weight written (no FSDP2: stack.gather_copy_out)


def step_features(st, d, stack, hbm: float, clip: bool) -> Features:
    """Memory-bound work once per step on one GPU of stage `st` (hbm: bytes/s), outside the
    micro-batches: the optimizer over this GPU's shard of the state (AdamW in one fused pass, and
    the gradient-norm clip where the run clips, `clip`: Config.clip_norm() > 0, training.max_norm
    on a stack that clips; torch's fused AdamW and foreach clip_grad_norm_, this runtime's clip
    (train/parallel.clip_grad_norm), Megatron's fused Adam and clip_grad_norm_fp32 read and write
    the same tensors), then what the weights' layout costs:
    - flat buffers (Megatron-Core's DDP and distributed optimizer): the gradient buffer zeroed for
      the next step and the bf16 weights refreshed from the fp32 master shard;
    - FSDP2 (stack.gather_copy_out): each weight all-gather copied out of its flat buffer into
      the parameters (bf16 read and written), per micro-batch forward and backward under ZeRO-3,
      once a step where the weights stay gathered (pipelining); each gradient reduce-scatter's
      input copied in from the bf16 gradients at the reduce dtype, every backward under ZeRO-3
      (FSDP2 reduce-scatters each backward unless told not to), the last one's under pipelining
      (torch.distributed.pipelining turns gradient sync off for the others).
    Not on a CPU, whose per-call host time the probe measures (plan/overheads.py)."""
    local, shard = held(st, d, 4), held(st, d, 1)  # what the GPU holds; its share of the optimizer's state
    nbytes = shard * (ADAMW_BYTES + (CLIP_BYTES if clip else 0.0))
    if not stack.gather_copy_out:
        return Features(elem=(nbytes + local * buffer_grad_bytes(stack) + shard * MASTER_COPY_BYTES) / hbm)
    if d.dp_shard * d.cp > 1:
        m = max(d.microbatches, 1)
        gathers, reduces = (2 * m, m) if d.zero == 3 else (1, 1)
        nbytes += local * (4.0 * gathers + (2.0 + reduce_grad_bytes(stack)) * reduces)
    return Features(elem=nbytes / hbm)


def stage_features(st, mm: ModelMath, s: Shape) -> Features:
    """Every layer of one pipeline rank (all its model chunks), plus the output layer."""
    frac = getattr(st, "recompute_frac", 1.0)
    if s.recompute == "full" and 0.0 <= frac < 1.0:  # some layers recomputed, the others not
        kept = _stage(st, mm, replace(s, recompute="none"))
        return _stage(st, mm, s).scale(frac) + kept.scale(1.0 - frac) if frac > 0 else kept
    return _stage(st, mm, s)


def _stage(st, mm: ModelMath, s: Shape) -> Features:
    if s.lowp and s.bf16_share > 0:  # the layers kept in BF16, as a share of every stage's
        f = s.bf16_share
        high = _stage(st, mm, replace(s, lowp="", bf16_share=0.0))
        return high.scale(f) + _stage(st, mm, replace(s, bf16_share=0.0)).scale(1.0 - f)
    mtp = getattr(st, "mtp", 0)
    moe_n = st.moe_layers
    dense_n = len(st.layers) + mtp - moe_n
    out = Features()
    if dense_n:
        out += layer_features(mm, False, s).scale(dense_n)
    if moe_n:
        out += layer_features(mm, True, s).scale(moe_n)
    if st.outputs:
        out += output_features(mm, s).scale(1 + mtp)  # the MTP modules share the output head
    return out

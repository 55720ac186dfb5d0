"""The byte inventory: what one GPU holds, stage by stage (where a layout starts).

Model states are 16 bytes per parameter (bf16 weights 2, bf16 gradients 2, fp32
master weights and Adam m and v 12; the stack's `grad_bytes` for gradients: Megatron,
Llama 3 and DeepSeek-V3 keep fp32 main gradients, 4), divided by TP x PP (each GPU holds its
stage's shard), and by the data-parallel group for whatever ZeRO/FSDP shards:
stage 1 the optimizer, 2 also gradients, 3 also weights (under pipelining, a stack that keeps the
weights gathered, stack.pp_keeps_weights_gathered, holds the gradients unsharded as well: torch's
pipeline stages defer FSDP2's reduce-scatter to the last micro-batch). FSDP shards over data
x context ranks, as torchtitan does. Expert weights are divided by the expert
grid's etp x ep and sharded over its expert-data-parallel group (edp).

Optimizer bytes per parameter are `training.optimizer_bytes` (12 by default).
Schedules that keep several copies of the weights (DeepSeek's DualPipe: two, Sec.
3.2.1) say so in their registry entry (config/schedules.py); DualPipe's second copy is
the mirror stage pp-1-r it runs for the other direction, so rank r holds stages r and
pp-1-r and half the activations of each.

Activations per micro-batch are the layer's bytes per token (model.py) x tokens
per GPU (s/cp x b), divided by TP (sequence parallelism shards what TP does
not). The number of micro-batches in flight is the schedule's: GPipe keeps all m;
1F1B keeps pp - i on stage i (the first stage a whole model's worth of layers);
interleaving multiplies by 1 + (pp-1)/(pp*vp) (Korthikanti et al. 2022), up to all m (the warmup
stops at every chunk of every micro-batch: config/schedules.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from orchestrator.plan.kernels import LOSSES, LOW_PRECISION, loss_kernels
from orchestrator.plan.stages import Stage, buffer_grad_bytes, held
from orchestrator.plan.layout import Layout

GiB = 1024**3


def fmt_bytes(b: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


# FP8 training with Transformer Engine caches the inputs of linear layers in one byte instead of
# two; they are most of a layer's activations, so the whole is taken as 0.6 of the bf16 figure. MXFP8
# and NVFP4 runs are taken as FP8's (NVFP4's wgrad copy is re-quantised after its Hadamard transform:
# no less). Stacks that save the bf16 inputs and cast again in backward (torchao's Float8Linear,
# torchtitan's float8) keep the bf16 figure: stack.fp8_saves_fp8=false.
FP8_ACT = 0.6


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    per_gpu_bytes: float
    capacity_bytes: float
    stage: int  # the stage that needs the most

    @property
    def fits(self) -> bool:
        return self.per_gpu_bytes <= self.capacity_bytes

    def to_json(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        out["per_gpu_gib"] = round(self.per_gpu_bytes / GiB, 2)
        out["capacity_gib"] = round(self.capacity_bytes / GiB, 2)
        return out


def in_flight(d: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak."""
    if d.pp == 1:
        return 1.0
    return d.schedule.held(d.pp, d.vp, d.microbatches, stage)


def _grad_bytes(spec) -> float:
    return buffer_grad_bytes(getattr(spec, "stack", None))


def stage_memory(st: Stage, d: Layout, hw, tr, vocab: int, spec=None, grad_bytes: float | None = None,
                 mirror: Stage | None = None) -> Memory:
    """One pipeline rank. `mirror`: the stage a bidirectional schedule (DualPipe) also runs on
    it, pp-1-r for the other direction: its weights, gradients and half the activations."""
    t, c = d.tp, d.cp
    shard = d.dp_shard * c  # FSDP / ZeRO group of dense weights (one copy of the state)

    gb = _grad_bytes(spec) if grad_bytes is None else grad_bytes
    stack = getattr(spec, "stack", None)
    # Under pipelining a stack that keeps the weights gathered (torch.distributed.pipelining with FSDP2)
    # keeps the gradients unsharded too: every micro-batch's backward but the last runs with
    # set_requires_gradient_sync(False) (PipelineStage.backward_maybe_with_nosync), and FSDP2 accumulates
    # each unsharded gradient in its reduce dtype (FSDPParam.to_accumulated_grad_if_needed: fp32,
    # stack.grad_bytes) until the last backward reduce-scatters it: held as the weights are.
    grad_level = 3 if d.pp > 1 and getattr(stack, "pp_keeps_weights_gathered", False) else 2
    if mirror is not None:
        params = 2.0 * (held(st, d, 3) + held(mirror, d, 3))
        grads = gb * (held(st, d, grad_level) + held(mirror, d, grad_level))
        optimizer = tr.optimizer_bytes * (held(st, d, 1) + held(mirror, d, 1)) / 2
        act_tok = (st.act_tok + mirror.act_tok) / 2
    else:
        copies = float(d.schedule.weight_copies)
        params = copies * 2.0 * held(st, d, 3)
        grads = copies * gb * held(st, d, grad_level)
        optimizer = tr.optimizer_bytes * held(st, d, 1)
        act_tok = st.act_tok
    tokens = tr.seq_len / c * tr.micro_batch
    fp8_saved = tr.precision.value in LOW_PRECISION and getattr(stack, "fp8_saves_fp8", True)
    acts = act_tok * tokens / t * in_flight(d, st.index) * (FP8_ACT if fp8_saved else 1.0)
    if tr.recompute == "full" and st.act_tok_layer_max:
        acts += st.act_tok_layer_max * tokens / t  # one layer re-materialised during backward
    if st.outputs or (mirror is not None and mirror.outputs):
        # the loss over the vocabulary at its peak: what its kernels keep of the logits (kernels.LOSSES)
        loss = getattr(stack, "cross_entropy", None)
        acts += LOSSES[loss_kernels(loss.value if loss is not None else "torch", t)].peak_bytes * tokens * vocab / t
    # Other: reserve, plus FSDP's all-gathered weights of two units (current and prefetched): a
    # layer each, or where the stack gathers per submodule (stack.zero3_gathers_per_layer > 1,
    # DeepSpeed) the largest submodule, about a third of a layer (an MLP linear's 4h^2 of 12h^2).
    gathers = getattr(getattr(spec, "stack", None), "zero3_gathers_per_layer", 1.0) or 1.0
    per_layer = (st.params - st.expert_params) / t / max(len(st.layers), 1) / min(max(gathers, 1.0), 3.0)
    other = hw.reserve_gb * GiB + (2 * 2.0 * per_layer if d.zero >= 3 and shard > 1 else 0.0)
    total = params + grads + optimizer + acts + other
    return Memory(params, grads, optimizer, acts, other, total, hw.gpu_memory_gb * GiB, st.index)


def inventory(stages: list[Stage], d: Layout, hw, tr, vocab: int, spec=None) -> Memory:
    """The worst stage's memory (the one that decides whether the layout fits)."""
    gb = _grad_bytes(spec)
    n = len(stages)
    bidirectional = d.schedule.weight_copies == 2 and d.schedule.chunks(d.vp) == 1 and n > 1  # DualPipe
    return max((stage_memory(st, d, hw, tr, vocab, spec, gb, stages[n - 1 - i] if bidirectional else None)
                for i, st in enumerate(stages)), key=lambda mem: mem.per_gpu_bytes)

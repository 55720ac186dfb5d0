"""Host time per collective call on a CPU (gloo) run: how many calls this runtime issues per
micro-batch and per step, at the per-call costs `orchestrate-calibrate --probe` measures.

On a tiny model over gloo a step is not its bytes: each collective call costs the host about
a millisecond (Python, DTensor dispatch, FSDP2's hooks and copies, gloo's rendezvous) whatever
it carries, and the runtime issues hundreds. The probe (orchestrator/probe.py) times each kind
of call through the API the runtime uses, at the tiny model's sizes (runtime_calls), and the
runtime's own model under each parallelism (model_calls, pipeline_calls); this module counts
the calls, ops and parameter tensors from the layout and the stage, torch-free:

- TP with sequence parallelism (torch.distributed.tensor.parallel, orchestrator/train/parallel.py):
  per block an all-gather before attention and the MLP and a reduce-scatter after each, forward,
  and the reverse in backward: 8 redistributes per layer per micro-batch; the embedding's
  output (reduce-scatter) and the final norm's gather into the head add 2 each way; the
  vocabulary-parallel loss (loss_parallel) a few small all-reduces (counted as 4 c10d calls).
  Every op of the model runs on DTensors (`dtensor_op_us` above the plain op's time), which the
  step pays in its compute (where the profiler finds it: outside the redistributes).
- CP (the runtime's all-gather attention, orchestrator/train/model.py): per layer K and V
  all-gathered forward and their gradients all-reduced backward: 4 calls, each at `cp_call_us`
  as the attention issues them (the probe times the runtime's own model under CP against it
  alone: the mask, the positions and the concatenation come with each call), a plain c10d
  call's where that is not measured.
- FSDP2 over dp_shard x cp ranks: per unit (each block and the root) its gather for forward
  and, resharded after forward (ZeRO-3 at pp = 1), again for backward, per micro-batch
  (`fsdp_gather_us`, the probe's: the runtime's own blocks, both gathers); its reduce-scatter once
  per step (`fsdp_reduce_us`). Under pipelining the weights stay gathered: one gather per step.
  Timed over a pair; each rank of a wider group adds `fsdp_gather_step_us` and
  `fsdp_reduce_step_us` per call (the probe's group of 4 against its pair).
- PP: per micro-batch and chunk the schedule's and PipelineStage's own host time around the
  stage's forward and backward, its sends and receives included (torch's schedules post them as
  batched point-to-point ops beside the stage's work, not as collectives between pieces of work):
  `pp_microbatch_us`, in the stage's compute, so the bubble pays it too. The sends on the critical
  path of fill and drain pay the wire's latency and bytes (plan/cost.py p2p).
- The optimizer: AdamW steps each parameter tensor of the stage once per step (`optimizer_us`),
  and a DTensor parameter (TP's shards, FSDP2's) costs `dtensor_optimizer_us` more: its update
  runs through DTensor's dispatch op by op. Counted in the step's compute, as the profile does.

Every call's host time scales with the core share (processes beyond the host's cores: plan/cost.py
_core_share).
The per-call costs are 0 on presets without them (every GPU preset): nothing changes there.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostCalls:
    """Host seconds per micro-batch (compute, tp, cp) and per step (dp, pp, optimizer) of one stage."""

    compute_mb: float = 0.0  # DTensor's dispatch of the model's ops, the pipelining schedule's (compute, as profiled)
    tp_mb: float = 0.0
    cp_mb: float = 0.0
    dp_step: float = 0.0
    pp_step: float = 0.0
    optimizer_step: float = 0.0
    calls: tuple = ()  # (axis, calls per step) as counted


def _us(hw, key: str) -> float:
    v = getattr(hw, key, 0.0) or 0.0
    return max(float(v), 0.0) * 1e-6


def parameter_tensors(st, mm) -> int:
    """Parameter tensors of one stage as the runtime builds them (orchestrator/train/model.py,
    moe.py: no biases): per dense layer 4 attention projections, 2 norms and the MLP's 2 or 3
    matrices; an MoE layer's router, its experts' stacked matrices and the shared experts'; the
    embedding, the final norm and the output layer where the stage holds them."""
    mats = 3 if mm.m.mlp == "swiglu" else 2
    dense = len(st.layers) - st.moe_layers
    moe = 6 + 1 + mats + (mats if mm.moe and mm.moe.shared_experts else 0)
    return dense * (6 + mats) + st.moe_layers * moe + int(st.embeds) + 2 * int(st.outputs)


def paid_terms(d) -> set[str]:
    """The probe's per-call keys (hardware.*_us) host_calls prices for layout `d`: what a plan's step
    rests on (plan/machine.py: a key the probe could not measure leaves no prediction for it)."""
    fsdp = d.dp_shard * d.cp > 1
    return ({"optimizer_us"} | ({"tp_call_us", "dtensor_op_us", "c10d_call_us"} if d.tp > 1 else set())
            | ({"cp_call_us"} if d.cp > 1 else set()) | ({"fsdp_gather_us", "fsdp_reduce_us"} if fsdp else set())
            | ({"fsdp_gather_step_us", "fsdp_reduce_step_us"} if d.dp_shard * d.cp > 2 else set())
            | ({"dtensor_optimizer_us"} if d.tp > 1 or fsdp else set())
            | ({"pp_microbatch_us"} if d.pp > 1 else set()))


def host_calls(st, d, kernels_mb: float, hw, share: float, mm) -> HostCalls:
    """`kernels_mb`: the kernels the shape model counts for one micro-batch of the stage."""
    tp_call, op, c10d = _us(hw, "tp_call_us"), _us(hw, "dtensor_op_us"), _us(hw, "c10d_call_us")
    wider = max(d.dp_shard * d.cp - 2, 0)  # FSDP2's ranks beyond a pair: each adds its step per call
    gather = _us(hw, "fsdp_gather_us") + wider * _us(hw, "fsdp_gather_step_us")
    reduce = _us(hw, "fsdp_reduce_us") + wider * _us(hw, "fsdp_reduce_step_us")
    cp_call = _us(hw, "cp_call_us") or c10d
    adam, adam_dt = _us(hw, "optimizer_us"), _us(hw, "dtensor_optimizer_us")
    schedule = _us(hw, "pp_microbatch_us")
    if not (tp_call or op or c10d or gather or reduce or cp_call or adam or adam_dt or schedule):
        return HostCalls()
    n, m = len(st.layers), d.microbatches
    tp = cp = dp = pp = ops = 0.0
    counts = []
    if d.tp > 1:
        redistributes = 8 * n + 2 * (st.embeds + st.outputs)
        loss = 4 if st.outputs else 0
        tp = redistributes * tp_call + loss * c10d
        ops = kernels_mb * op
        counts.append(("tp", m * (redistributes + loss)))
    if d.cp > 1:
        cp = 4 * n * cp_call
        counts.append(("cp", m * 4 * n))
    if d.dp_shard * d.cp > 1:
        units = n + 1
        if d.pp == 1:
            per_mb = 1.0 if d.zero == 3 else 0.5  # the probe's unit gathers twice (forward, backward)
            dp = units * (m * per_mb * gather + reduce)
            counts.append(("dp", units * (m * (2 if d.zero == 3 else 1) + 1)))
        else:
            dp = units * (0.5 * gather + reduce)
            counts.append(("dp", units * 2))
    if d.pp > 1:  # the sends' host time is the schedule's (pp_microbatch_us)
        ops += d.chunks * schedule
        counts.append(("pp", 2 * m * d.chunks))
    opt = 0.0
    if adam or adam_dt:
        dtensor = d.tp > 1 or d.dp_shard * d.cp > 1  # TP's shards and FSDP2's are DTensors
        opt = parameter_tensors(st, mm) * (adam + (adam_dt if dtensor else 0.0))
    return HostCalls(ops * share, tp * share, cp * share, dp * share, pp * share, opt * share, tuple(counts))

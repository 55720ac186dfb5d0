"""Host time per collective call on a CPU (gloo) run: how many calls this runtime issues per
micro-batch and per step, at the per-call costs `orchestrate-calibrate --probe` measures.

On a tiny model over gloo a step is not its bytes: each collective call costs the host about
a millisecond (Python, DTensor dispatch, FSDP2's hooks and copies, gloo's rendezvous) whatever
it carries, and the runtime issues hundreds. The probe (orchestrator/probe.py runtime_calls)
times each kind of call through the API the runtime uses, at the tiny model's sizes, and this
module counts them from the layout and the stage, torch-free:

- TP with sequence parallelism (torch.distributed.tensor.parallel, orchestrator/train/parallel.py):
  per block an all-gather before attention and the MLP and a reduce-scatter after each, forward,
  and the reverse in backward: 8 redistributes per layer per micro-batch; the embedding's
  output (reduce-scatter) and the final norm's gather into the head add 2 each way; the
  vocabulary-parallel loss (loss_parallel) a few small all-reduces (counted as 4 c10d calls).
  Every op of the block runs on DTensors (`dtensor_op_us` above the plain op's time).
- CP (the runtime's all-gather attention, orchestrator/train/model.py): per layer K and V
  all-gathered forward and their gradients all-reduced backward: 4 c10d calls.
- FSDP2 over dp_shard x cp ranks: per unit (each block and the root) its gather for forward
  and, resharded after forward (ZeRO-3 at pp = 1), again for backward, per micro-batch
  (`fsdp_gather_us`, the probe's fully_shard unit with both); its gradient reduce-scatter once
  per step (`fsdp_reduce_us`). Under pipelining the weights stay gathered: one gather per step.
- PP: a send or receive per micro-batch per direction and chunk (c10d calls).

Every call's host time scales with the core share (processes beyond the host's cores).
The per-call costs are 0 on presets without them (every GPU preset): nothing changes there.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostCalls:
    """Host seconds per micro-batch (tp, cp) and per step (dp, pp) of one stage."""

    tp_mb: float = 0.0
    cp_mb: float = 0.0
    dp_step: float = 0.0
    pp_step: float = 0.0
    calls: tuple = ()  # (axis, calls per step) as counted


def _us(hw, key: str) -> float:
    v = getattr(hw, key, 0.0) or 0.0
    return max(float(v), 0.0) * 1e-6


def host_calls(st, d, kernels_mb: float, hw, share: float) -> HostCalls:
    """`kernels_mb`: the kernels the shape model counts for one micro-batch of the stage."""
    tp_call, op, c10d = _us(hw, "tp_call_us"), _us(hw, "dtensor_op_us"), _us(hw, "c10d_call_us")
    gather, reduce = _us(hw, "fsdp_gather_us"), _us(hw, "fsdp_reduce_us")
    if not (tp_call or op or c10d or gather or reduce):
        return HostCalls()
    n, m = len(st.layers), d.microbatches
    tp = cp = dp = pp = 0.0
    counts = []
    if d.tp > 1:
        redistributes = 8 * n + 2 * (st.embeds + st.outputs)
        loss = 4 if st.outputs else 0
        tp = redistributes * tp_call + loss * c10d + kernels_mb * op
        counts.append(("tp", m * (redistributes + loss)))
    if d.cp > 1:
        cp = 4 * n * c10d
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
    if d.pp > 1:
        pp = 2 * m * d.chunks * c10d
        counts.append(("pp", 2 * m * d.chunks))
    return HostCalls(tp * share, cp * share, dp * share, pp * share, tuple(counts))

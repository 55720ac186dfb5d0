"""Structural validation: degrees against the allocation and every divisibility rule.

Collects every problem (never stops at the first); each names the key(s), the
numbers and a fix. Memory and cross-node TP are judged later, once the byte
inventory and the cost model have numbers to quote (see plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.schema import SCHEDULES
from orchestrator.plan.errors import Problem
from orchestrator.plan.topology import OrderError, parse_order

INTERLEAVED = {"interleaved_1f1b"}


@dataclass
class Degrees:
    """The resolved layout: every number the cost model and the runtime need."""

    world: int
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    vp: int
    zero: int
    microbatches: int
    stage_layers: list[int]
    schedule: str
    order: list[str] | None  # None = auto
    warnings: list[str] = field(default_factory=list)

    @property
    def replica(self) -> int:
        """GPUs that must all be alive for one data-parallel replica (TP x CP x PP x EP)."""
        return self.tp * self.cp * self.pp * self.ep

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp // self.ep, "pp": self.pp}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest_multiples(x: int, k: int) -> tuple[int, int]:
    lo = (x // k) * k
    return (lo if lo > 0 else k), lo + k


def uneven_split(layers: int, pp: int) -> list[int] | None:
    """An uneven split that lightens the ends, which also hold the embedding and the
    output layer: Llama 3 405B's 126 layers on 16 stages are [7, 8, ..., 8, 7]."""
    if pp < 2 or layers < pp or layers % pp == 0:
        return None
    k = -(-layers // pp)
    split = [k] * pp
    deficit = k * pp - layers
    ends = [i for pair in zip(range(pp), reversed(range(pp))) for i in pair]
    for i in ends[:deficit]:
        split[i] -= 1
    return split if min(split) >= 1 and sum(split) == layers else None


def virtual_stages(stage_layers: list[int], vp: int, schedule: str = "interleaved_1f1b") -> list[tuple[int, int]]:
    """Layer ranges [start, end) of the pp x vp virtual stages, in pipeline order.

    Virtual stage j runs on pipeline rank j % pp (chunk j // pp) for looped/interleaved
    schedules; each rank's layers are split as evenly as possible over its chunks.
    """
    pp = len(stage_layers)
    sizes = []
    for j in range(pp * vp):
        r, k = j % pp, j // pp
        n = stage_layers[r]
        sizes.append(n // vp + (1 if k < n % vp else 0))
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def stage_ids_of_rank(pp_rank: int, pp: int, vp: int) -> list[int]:
    """The virtual stages a pipeline rank runs (looped placement)."""
    return [pp_rank + k * pp for k in range(vp)]


def validate(spec) -> tuple[Degrees | None, list[Problem], list[str]]:
    problems: list[Problem] = []
    warnings: list[str] = []
    P = problems.append
    hw, m, tr, lay, cl = spec.hardware, spec.model, spec.training, spec.layout, spec.cluster

    # --- values that must be positive -----------------------------------------------
    positive = {
        "cluster.nodes": cl.nodes, "hardware.gpus_per_node": hw.gpus_per_node,
        "hardware.gpu_memory_gb": hw.gpu_memory_gb, "hardware.peak_tflops": hw.peak_tflops,
        "hardware.intra_node_gbps": hw.intra_node_gbps, "hardware.inter_node_gbps": hw.inter_node_gbps,
        "hardware.kernel_efficiency": hw.kernel_efficiency,
        "model.layers": m.layers, "model.hidden": m.hidden, "model.ffn_hidden": m.ffn_hidden,
        "model.heads": m.heads, "model.kv_heads": m.kv_heads, "model.vocab": m.vocab,
        "training.seq_len": tr.seq_len, "training.global_batch": tr.global_batch,
        "training.micro_batch": tr.micro_batch,
        "layout.tp": lay.tp, "layout.cp": lay.cp, "layout.pp": lay.pp, "layout.ep": lay.ep, "layout.vp": lay.vp,
    }
    for key, val in positive.items():
        if not (val > 0):
            P(Problem(key, f"must be positive, got {val}.", f"set {key} to a value >= 1."))
    for t in hw.tiers:
        if t.size <= 0 or (t.gbps is not None and t.gbps <= 0) or t.oversubscription <= 0:
            P(Problem("hardware.tiers", f"tier {t.name!r} needs size > 0, gbps > 0, oversubscription > 0.",
                      "fix the tier in the hardware preset."))
    if hw.kernel_efficiency > 1:
        P(Problem("hardware.kernel_efficiency", f"is a fraction of peak, got {hw.kernel_efficiency}.",
                  "use a value in (0, 1], e.g. 0.6."))
    if lay.zero not in (0, 1, 2, 3):
        P(Problem("layout.zero", f"must be 0 (DDP), 1, 2 or 3 (FSDP), got {lay.zero}.", "set layout.zero=3."))
    if spec.schedule.name not in SCHEDULES:
        P(Problem("schedule.name", f"unknown schedule {spec.schedule.name!r}.", f"use one of {list(SCHEDULES)}."))
    try:
        order = parse_order(lay.order)
    except OrderError as e:
        P(Problem("layout.order", str(e) + f" (got {lay.order!r}).", "e.g. layout.order=[tp,cp,pp,dp] or auto."))
        order = None
    dp_raw = lay.dp
    if not (dp_raw == "auto" or (isinstance(dp_raw, int) and not isinstance(dp_raw, bool) and dp_raw > 0)):
        P(Problem("layout.dp", f"must be a positive integer or 'auto', got {dp_raw!r}.", "set layout.dp=auto."))
    if problems:
        return None, problems, warnings

    t, c, p, ep, v = lay.tp, lay.cp, lay.pp, lay.ep, lay.vp
    gpn, nodes = hw.gpus_per_node, cl.nodes
    world = nodes * gpn
    mp = t * c * p
    world_txt = f"WORLD_SIZE {world} (cluster.nodes {nodes} x hardware.gpus_per_node {gpn})"

    # --- the product against the allocation -----------------------------------------
    if dp_raw == "auto":
        if world % mp:
            fits = [n for n in range(max(1, nodes - 64), nodes + 65) if (n * gpn) % mp == 0][:1]
            fix = f"use cluster.nodes={fits[0]}" if fits else "change the degrees"
            P(Problem("layout.tp, layout.cp, layout.pp, cluster.nodes",
                      f"tp({t}) * cp({c}) * pp({p}) = {mp} does not divide {world_txt}, so no dp fits.",
                      f"{fix}, or pick degrees whose product divides {world}."))
            dp = 0
        else:
            dp = world // mp
    else:
        dp = dp_raw
        if mp * dp != world:
            fix = (f"dp={world // mp} would fit (or layout.dp=auto)." if world % mp == 0 else
                   f"no dp fits: tp*cp*pp = {mp} does not divide {world}; change the degrees.")
            if (mp * dp) % gpn == 0:
                fix += f" This product needs cluster.nodes={mp * dp // gpn}."
            P(Problem("layout.dp, cluster.nodes",
                      f"dp({dp}) * cp({c}) * tp({t}) * pp({p}) = {mp * dp} != {world_txt}.", fix))
    if dp and dp % ep:
        P(Problem("layout.ep, layout.dp",
                  f"expert parallelism is carved out of data parallelism: dp {dp} is not a multiple of ep {ep}.",
                  f"use an ep from {[x for x in _divisors(dp) if x <= 256][-6:]}."))

    # --- tensor parallel against the node and the shapes -----------------------------
    if t > gpn or gpn % t:
        if lay.allow_cross_node_tp:
            warnings.append(f"layout.tp={t} does not fit in a node of {gpn} GPUs: its collectives cross "
                            f"the network (allowed by layout.allow_cross_node_tp); see the TP row of the axes.")
        # else: judged in plan.py with the cost of crossing quoted.
    if m.heads % t:
        P(Problem("layout.tp, model.heads", f"{m.heads} attention heads do not split over tp={t}.",
                  f"use tp in {[d for d in _divisors(m.heads) if d <= gpn]}."))
    if m.kv_heads % t:
        if t % m.kv_heads == 0:
            warnings.append(f"model.kv_heads={m.kv_heads} < tp={t}: each KV head is replicated on "
                            f"{t // m.kv_heads} TP ranks (Megatron does the same).")
        else:
            P(Problem("layout.tp, model.kv_heads",
                      f"{m.kv_heads} KV heads neither split over nor replicate evenly onto tp={t}.",
                      f"use tp in {[d for d in _divisors(m.kv_heads)] + [m.kv_heads * k for k in (2, 4, 8)]}."))
    ffn = m.moe.expert_ffn_hidden if m.moe.experts else m.ffn_hidden
    if ffn % t:
        warnings.append(f"model.ffn_hidden={ffn} is not divisible by tp={t}: padded to {-(-ffn // t) * t}.")
    if m.vocab % t:
        warnings.append(f"model.vocab={m.vocab} is not divisible by tp={t}: the vocabulary-parallel "
                        f"embedding pads it to {-(-m.vocab // t) * t}.")
    if ep > 1 and m.moe.experts == 0:
        P(Problem("layout.ep, model.moe.experts", f"ep={ep} needs a mixture-of-experts model; "
                  f"{m.name} is dense.", "set layout.ep=1."))
    elif m.moe.experts and m.moe.experts % ep:
        P(Problem("layout.ep, model.moe.experts", f"{m.moe.experts} experts do not split over ep={ep}.",
                  f"use ep in {[d for d in _divisors(m.moe.experts)][-6:]}."))

    # --- layers against the pipeline -------------------------------------------------
    stage_layers: list[int] = []
    if lay.stage_layers is not None:
        sl = list(lay.stage_layers)
        if len(sl) != p or sum(sl) != m.layers or min(sl, default=0) < v:
            P(Problem("layout.stage_layers",
                      f"needs {p} entries (layout.pp) summing to model.layers={m.layers}, each >= vp={v}; "
                      f"got {len(sl)} entries summing to {sum(sl)}.",
                      f"e.g. layout.stage_layers={uneven_split(m.layers, p) or [m.layers // p] * p}."))
        else:
            stage_layers = sl
    elif p > m.layers:
        P(Problem("layout.pp, model.layers", f"pp={p} stages for {m.layers} layers.",
                  f"use pp <= {m.layers}."))
    elif m.layers % (p * v):
        alt = uneven_split(m.layers, p)
        good_vp = [x for x in _divisors(m.layers // p) if x <= 8] if m.layers % p == 0 else []
        fix = []
        if alt and min(alt) >= v:
            fix.append(f"split unevenly with layout.stage_layers=[{','.join(map(str, alt))}] "
                       f"(first and last stage one layer fewer, as Llama 3 405B)")
        if good_vp:
            fix.append(f"use vp in {good_vp}")
        fix.append(f"use pp in {[d for d in _divisors(m.layers) if d <= 128 and d > 1][:8]}")
        P(Problem("layout.pp, layout.vp, model.layers",
                  f"model.layers={m.layers} does not split into pp({p}) x vp({v}) = {p * v} equal chunks.",
                  "; or ".join(fix) + "."))
    else:
        stage_layers = [m.layers // p] * p

    schedule = spec.schedule.name
    if v > 1 and schedule not in INTERLEAVED:
        P(Problem("layout.vp, schedule.name", f"vp={v} virtual stages need an interleaved schedule, "
                  f"not {schedule}.", "use schedule=interleaved_1f1b, or layout.vp=1."))
    if schedule in INTERLEAVED and p == 1:
        warnings.append("schedule=interleaved_1f1b with pp=1 has nothing to interleave.")

    # --- sequence against context and sequence parallelism ----------------------------
    s = tr.seq_len
    if c > 1 and s % (2 * c):
        P(Problem("training.seq_len, layout.cp",
                  f"context parallelism cuts the sequence into 2 x cp = {2 * c} load-balanced chunks; "
                  f"seq_len {s} is not divisible by {2 * c}.",
                  f"use seq_len={-(-s // (2 * c)) * 2 * c} or a cp that divides {s // 2}."))
    elif t > 1 and lay.sequence_parallel and (s // c) % t:
        P(Problem("training.seq_len, layout.tp", f"sequence parallelism shards each rank's {s // c} tokens "
                  f"over tp={t}, which does not divide them.",
                  "use a seq_len divisible by cp*tp, or layout.sequence_parallel=false."))

    # --- batch against data parallelism and micro-batches ----------------------------
    B, b = tr.global_batch, tr.micro_batch
    mb = 0
    if dp:
        if B % (dp * b):
            lo, hi = _nearest_multiples(B, dp * b)
            P(Problem("training.global_batch, layout.dp, training.micro_batch",
                      f"global_batch {B} is not a multiple of dp {dp} x micro_batch {b} = {dp * b}.",
                      f"use training.global_batch={lo} or {hi}" +
                      (", or training.micro_batch=1" if b > 1 and B % dp == 0 else "") + "."))
        else:
            mb = B // (dp * b)
            if spec.schedule.microbatches not in (None, mb):
                P(Problem("schedule.microbatches", f"set to {spec.schedule.microbatches}, but global_batch {B} / "
                          f"(dp {dp} x micro_batch {b}) = {mb}.", "leave schedule.microbatches unset."))
    if mb and p > 1:
        if schedule in INTERLEAVED and mb % p:
            P(Problem("schedule.name, training.global_batch, layout.pp",
                      f"interleaved 1F1B runs micro-batches in rounds of pp: {mb} micro-batches is not a "
                      f"multiple of pp={p}.",
                      f"make global_batch / (dp x micro_batch) a multiple of {p}, e.g. "
                      f"training.global_batch={-(-mb // p) * p * dp * b}."))
        elif schedule in ("1f1b", "zero_bubble", "dualpipe", "interleaved_1f1b") and mb < p:
            P(Problem("schedule.name, training.global_batch, layout.pp",
                      f"{schedule} needs at least pp={p} micro-batches to fill the pipeline, got {mb} "
                      f"(bubble {(p - 1) / (mb + p - 1):.0%}).",
                      f"raise training.global_batch to {p * dp * b}, lower training.micro_batch, "
                      f"or use fewer stages."))
        if schedule == "dualpipe" and mb % 2:
            P(Problem("schedule.name, training.global_batch",
                      f"DualPipe feeds micro-batches from both ends: {mb} is odd.",
                      "use an even number of micro-batches."))
    if problems:
        return None, problems, warnings
    return Degrees(world=world, tp=t, cp=c, pp=p, dp=dp, ep=ep, vp=v, zero=lay.zero, microbatches=mb,
                   stage_layers=stage_layers, schedule=schedule, order=order, warnings=warnings), problems, warnings

"""The plan as a readable table (stdout) and as Markdown (plan.md)."""
from __future__ import annotations

from orchestrator.plan.inventory import GiB

STEP_PARTS = (("compute", "arithmetic"), ("tp", "TP collectives"), ("cp", "CP collectives"),
              ("ep", "EP all-to-all"), ("pp_bubble", "pipeline bubble"), ("p2p", "P2P sends"),
              ("dp_exposed", "exposed DP"))


def _fmt_bytes(b: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def _fmt_s(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"


def _lines(plan) -> list[str]:
    sp = plan.spec
    L = []
    title = f"{sp.model.name} on {plan.world_size} x {sp.hardware.name} ({sp.cluster.nodes} nodes x {sp.hardware.gpus_per_node})"
    if getattr(sp, "recipe_name", None):
        title = f"recipe {sp.recipe_name}: " + title
    L.append(title)
    L.append("=" * len(title))
    d = plan.degrees
    if d:
        L.append(f"layout   TP{d.tp} CP{d.cp} PP{d.pp} DP{d.dp}" + (f" EP{d.ep}" if d.ep > 1 else "") +
                 (f" VP{d.vp}" if d.vp > 1 else "") + f"  order (innermost first) {'-'.join(plan.order)}")
        L.append(f"batch    global {sp.training.global_batch} x seq {sp.training.seq_len}, micro-batch "
                 f"{sp.training.micro_batch}, {d.microbatches} micro-batches, schedule {d.schedule}, "
                 f"recompute {sp.training.recompute}, ZeRO-{d.zero}")
        if d.pp > 1 and len(set(d.stage_layers)) > 1:
            L.append(f"stages   layers per stage {d.stage_layers}")
    if plan.params:
        L.append(f"model    {plan.params / 1e9:.1f}B parameters" +
                 (f" ({plan.active_params / 1e9:.1f}B active)" if plan.active_params != plan.params else ""))
    if plan.memory:
        m = plan.memory
        L.append("")
        L.append(f"memory per GPU (stage {m.stage}, the fullest)    {'fits' if m.fits else 'DOES NOT FIT'}")
        for k in ("params", "grads", "optimizer", "activations", "other"):
            L.append(f"  {k:<12} {getattr(m, k) / GiB:8.2f} GiB")
        L.append(f"  {'total':<12} {m.per_gpu_bytes / GiB:8.2f} GiB of {m.capacity_bytes / GiB:.0f} GiB")
    if plan.step:
        st = plan.step
        L.append("")
        L.append(f"step-time budget (roofline; slowest stage {st.stage})")
        for key, label in STEP_PARTS:
            v = getattr(st, key)
            if v > 0 or key in ("compute",):
                L.append(f"  {label:<16} {_fmt_s(v):>12}  {v / st.total_s:6.1%}")
        L.append(f"  {'total':<16} {_fmt_s(st.total_s):>12}")
        L.append(f"  predicted wall-clock step {st.wall_s:.3f} s at kernel efficiency "
                 f"{sp.hardware.kernel_efficiency:.2f}")
        L.append(f"  MFU {plan.mfu:.1%}   HFU {plan.hfu:.1%}   {plan.tflops_per_gpu:.0f} TFLOP/s per GPU   "
                 f"{plan.tokens_per_s:,.0f} tokens/s")
        pub = getattr(sp, "published", None)
        if pub is not None and pub.mfu is not None:
            ours = plan.hfu if pub.metric == "hfu" else plan.mfu
            L.append(f"  published {pub.metric.upper()} {pub.mfu:.1%} ({pub.tflops_per_gpu} TFLOP/s) vs predicted "
                     f"{ours:.1%}: {100 * (ours - pub.mfu):+.1f} points  [{pub.source}]")
        L.append("")
        L.append("axes (busiest first)")
        L.append(f"  {'axis':<4} {'size':>5}  {'collective':<38} {'calls/step':>10} {'bytes/step/GPU':>15} "
                 f"{'tier':<8} {'GB/s':>6} {'time':>10} {'exposed':>10}")
        for name in plan.order:
            a = plan.axes.get(name)
            if a is None or a.size <= 1:
                continue
            L.append(f"  {a.name:<4} {a.size:>5}  {a.collective:<38} {a.calls_per_step:>10.0f} "
                     f"{_fmt_bytes(a.bytes_per_step):>15} {a.tier:<8} {a.gbps:>6.1f} {_fmt_s(a.seconds):>10} "
                     f"{_fmt_s(a.exposed_s):>10}")
        br = plan.blast_radius
        L.append("")
        L.append(f"blast radius  {br['gpus_per_replica']} GPUs per replica must be alive together; one node "
                 f"failure takes down {br['replicas_lost_per_node_failure']} of {br['replicas']} replicas")
        if br["checkpoint_interval_s"]:
            L.append(f"  job MTBF {br['job_mtbf_hours']:.1f} h; checkpoint {_fmt_bytes(br['checkpoint_bytes'])} "
                     f"in {br['checkpoint_seconds']:.1f} s; Young/Daly interval "
                     f"{br['checkpoint_interval_s'] / 60:.1f} min (overhead {br['expected_overhead']:.1%})")
    if plan.search:
        L.append("")
        L.append("layout search (ranked by predicted step time)")
        for row in plan.search.get("top", []):
            L.append(f"  #{row['rank']}: {row['layout']}  step {row['wall_s']:.2f} s  MFU {row['mfu']:.1%}  "
                     f"memory {row['memory_gib']:.1f} GiB")
        for why in plan.search.get("rejected", [])[:8]:
            L.append(f"  - {why}")
    for w in plan.warnings:
        L.append(f"warning: {w}")
    for e in plan.errors:
        L.append(f"ERROR {e}")
    return L


def render_table(plan) -> str:
    return "\n".join(_lines(plan))


def render_markdown(plan) -> str:
    body = "\n".join(_lines(plan))
    head = "# Plan\n\n" + ("**valid**" if plan.valid else "**REJECTED**") + "\n\n"
    figs = "\n\n![cluster](cluster.png)\n\n![step budget](step_budget.png)\n" if plan.valid else "\n"
    return head + "```\n" + body + "\n```" + figs

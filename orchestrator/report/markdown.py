"""The plan as a readable table (stdout) and as Markdown (plan.md)."""
from __future__ import annotations

from orchestrator.plan.inventory import GiB, fmt_bytes
from orchestrator.plan.uncertainty import ATTENTION_BAND
from orchestrator.plan.validate import configured_zero

STEP_PARTS = (("compute", "arithmetic"), ("tp", "TP collectives"), ("cp", "CP collectives"),
              ("ep", "EP all-to-all"), ("pp_bubble", "pipeline bubble"), ("p2p", "P2P sends"),
              ("dp_exposed", "exposed DP"))


def _fmt_s(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"


def _fmt_count(n: float) -> str:
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.1f}{unit}"
    return f"{n:.0f}"


def _fmt_mem(b: float) -> str:
    """Bytes in GiB, or MiB/KiB when that would print 0.00."""
    for unit, k in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= 0.01 * k or unit == "KiB":
            return f"{b / k:8.2f} {unit}"
    return f"{b:8.0f} B"


def _fmt_flops(tflops: float) -> str:
    for unit, k in (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3), ("MFLOP/s", 1e-6)):
        if tflops >= k:
            return f"{tflops / k:.1f} {unit}"
    return f"{tflops * 1e12:.0f} FLOP/s"


def _lines(plan) -> list[str]:
    sp = plan.spec
    if sp is None:
        return [f"ERROR {e}" for e in plan.errors]
    L = _header(plan)
    if plan.memory:
        L += _memory(plan)
    if plan.step:
        L += _budget(plan) + _axes(plan) + _blast(plan)
    if plan.placement is not None:
        L += placement_lines(plan.placement)
    if plan.search:
        top = plan.search.get("top", [])
        by = "the low end of the 80% MFU interval" if top and top[0].get("mfu_interval") else "predicted step time"
        L += ["", f"layout search (ranked by {by})"]
        for row in top:
            iv = row.get("mfu_interval")
            L.append(f"  #{row['rank']}: {row['layout']}  step {row['wall_s']:.2f} s  MFU {row['mfu']:.1%}"
                     + (f" [{iv[0]:.1%}, {iv[1]:.1%}]" if iv else "") + f"  memory {row['memory_gib']:.1f} GiB")
        L += [f"  - {why}" for why in plan.search.get("rejected", [])[:8]]
    L += [f"warning: {w}" for w in plan.warnings]
    return L + [f"ERROR {e}" for e in plan.errors]


def _header(plan) -> list[str]:
    sp, d = plan.spec, plan.layout
    title = f"{sp.model.name} on {plan.world_size} x {sp.hardware.name} ({sp.cluster.nodes} nodes x {sp.hardware.gpus_per_node})"
    if sp.recipe_name:
        title = f"recipe {sp.recipe_name}: " + title
    L = [title, "=" * len(title)]
    if d:
        L.append(f"layout   {d.label()}  order (innermost first) {'-'.join(plan.order)}")
        L.append(f"batch    global {sp.training.global_batch} x seq {sp.training.seq_len}, micro-batch "
                 f"{sp.training.micro_batch}, {d.microbatches} micro-batches, schedule {d.schedule.name}, "
                 f"recompute {sp.training.recompute.value}, ZeRO-{d.zero}" + _zero_note(sp, d))
        if d.pp > 1 and len(set(d.stage_layers)) > 1:
            L.append(f"stages   layers per stage {d.stage_layers}")
    if plan.params:
        L.append(f"model    {_fmt_count(plan.params)} parameters" +
                 (f" ({_fmt_count(plan.active_params)} active)" if plan.active_params != plan.params else ""))
    return L


def _zero_note(sp, d) -> str:
    if configured_zero(sp) == 3 and d.zero == 2:  # stack.pp_keeps_weights_gathered
        return " (ZeRO-3's weights stay gathered under pipelining)"
    return ""


def _memory(plan) -> list[str]:
    m = plan.memory
    L = ["", f"memory per GPU (stage {m.stage}, the fullest)    {'fits' if m.fits else 'DOES NOT FIT'}"]
    L += [f"  {k:<12} {_fmt_mem(getattr(m, k))}" for k in ("params", "grads", "optimizer", "activations", "other")]
    return L + [f"  {'total':<12} {_fmt_mem(m.per_gpu_bytes)} of {m.capacity_bytes / GiB:g} GiB"]


def _budget(plan) -> list[str]:
    sp, st = plan.spec, plan.step
    L = ["", f"step-time budget (roofline; slowest stage {st.stage})"]
    L += [f"  {label:<16} {_fmt_s(getattr(st, key)):>12}  {getattr(st, key) / st.total_s:6.1%}"
          for key, label in STEP_PARTS if getattr(st, key) > 0 or key == "compute"]
    L.append(f"  {'total':<16} {_fmt_s(st.total_s):>12}")
    hw = sp.hardware
    model = (sp.cost.kernel_model or hw.kernel_model).value
    L.append(f"  predicted wall-clock step {_fmt_s(st.wall_s)} = roofline / effective kernel efficiency "
             f"{st.kernel_efficiency:.3g} ({model} kernel model, preset hardware={hw.name})")
    if hw.device.value == "cpu" and model == "constant":
        L.append(f"  hardware={hw.name} runs processes on this machine; its kernel efficiency is fitted to demo runs")
        L.append("  (orchestrate-calibrate), so this is no prediction for another layout or machine: measure this")
        L.append("  machine once with orchestrate-calibrate --probe (cached; hardware=cpu then predicts with it)")
    elif hw.device.value == "cpu":
        L.append(f"  hardware={hw.name} runs processes on this machine, priced from its measured components")
        L.append("  (orchestrate-calibrate --probe: GEMM rate, per-op and per-call host time, cores)")
    pred = plan.prediction
    if pred and not pred["is_prediction"] and pred["basis"] == "probe":
        L.append("  NOT a prediction for this layout: " + "; ".join(pred["not_measured"]))
    L.append(f"  MFU {_fmt_pct(plan.mfu)}   HFU {_fmt_pct(plan.hfu)}   {_fmt_flops(plan.tflops_per_gpu)} per GPU   "
             f"{plan.tokens_per_s:,.0f} tokens/s")
    L.append(_interval_line(plan))
    pub = sp.published
    if pub is not None and pub.mfu is not None:
        ours = plan.hfu if pub.metric == "hfu" else plan.mfu
        tflops = f" ({pub.tflops_per_gpu:g} TFLOP/s)" if pub.tflops_per_gpu is not None else ""
        L.append(f"  published {pub.metric.value.upper()} {pub.mfu:.1%}{tflops} vs predicted "
                 f"{ours:.1%}: {100 * (ours - pub.mfu):+.1f} points  [{pub.source}]")
    return L


def _interval_line(plan) -> str:
    if plan.mfu_interval is None:
        return "  MFU interval: none (calibrated on GPU runs with the shape kernel model)"
    lo, hi = plan.mfu_interval
    key = plan.mfu_interval_basis
    own = key.split("/")[0] == plan.spec.stack.name
    attn = plan.attention_share or 0.0
    return (f"  MFU 80% interval {_fmt_pct(lo)} - {_fmt_pct(hi)} (published runs nobody fitted on, group {key}"
            + ("" if own else f"; stack {plan.spec.stack.name} has too few of its own")
            + (f"; attention kernel {attn:.0%} of the step, which another release runs up to "
               f"{1 + ATTENTION_BAND[0]:.2f}x as long or {ATTENTION_BAND[1]:.0%} faster" if attn >= 0.005 else "") + ")")


def _axes(plan) -> list[str]:
    L = ["", "axes (busiest first)",
         f"  {'axis':<4} {'size':>5}  {'collective':<38} {'calls/step':>10} {'bytes/step/GPU':>15} "
         f"{'tier':<8} {'GB/s':>6} {'time':>10} {'exposed':>10}"]
    names = [a for a in plan.order if a in plan.axes] + [a for a in plan.axes if a not in plan.order]
    for a in (plan.axes[n] for n in names):
        if a.size > 1 and (a.calls_per_step or a.name in ("tp", "cp", "pp")):
            L.append(f"  {a.name:<4} {a.size:>5}  {a.collective:<38} {a.calls_per_step:>10.0f} "
                     f"{fmt_bytes(a.bytes_per_step):>15} {a.tier:<8} {a.gbps:>6.1f} {_fmt_s(a.seconds):>10} "
                     f"{_fmt_s(a.exposed_s):>10}")
    return L


def _blast(plan) -> list[str]:
    br = plan.blast_radius
    L = ["", f"blast radius  {br['gpus_per_replica']} GPUs per replica must be alive together; one node "
             f"failure takes down {br['replicas_lost_per_node_failure']} of {br['replicas']} replicas"]
    if br["checkpoint_interval_s"]:
        L.append(f"  job MTBF {br['job_mtbf_hours']:.1f} h; checkpoint {fmt_bytes(br['checkpoint_bytes'])} "
                 f"in {_fmt_s(br['checkpoint_seconds'])}; Young/Daly interval "
                 f"{br['checkpoint_interval_s'] / 60:.1f} min (overhead {br['expected_overhead']:.1%})")
        from orchestrator.plan.goodput import goodput

        g = goodput(plan)
        L.append(f"  goodput: predicted ETTR {g['predicted_ettr']:.1%} ("
                 + ("in place" if g["in_place"] else "restart") + f": a failure costs ~{_fmt_s(g['lost_per_failure_s'])})")
        if g.get("checkpoint_level") == "peer_memory":  # plan/goodput.py: what a restart reads back, and the spares
            L.append(f"  checkpoint level for restarts: a snapshot in a peer node's host memory every "
                     f"{g['checkpoint_interval_s'] / 60:.1f} min (Young/Daly on the failures that restart; blocking "
                     f"{_fmt_s(g['snapshot_s'])}, overhead {g['checkpoint_overhead']:.2%}), the file system in the "
                     f"background; warm spare copies {g['spare_copies']} ({g['spares_from']}): a failure finds none "
                     f"{g['no_spare_chance']:.1%} of the time and the copies then shrink in place")
        if g.get("takeover_s") is not None:  # SLURM, more than one node: launch/batch.py, launch/lease.py
            L.append(f"  supervisor's node lost: a standby on the last node takes over when the lease expires "
                     f"({_fmt_s(g['takeover_s'])}, failover.lease_s) and restarts in the same allocation "
                     f"(~{_fmt_s(g['supervisor_lost_s'])} lost)")
    snap = br.get("snapshot") or {}
    if snap.get("every_steps"):  # plan/goodput.snapshot_every: what the runtime takes (train/keeper.py)
        L.append(f"  memory snapshots: every {snap['every_steps']} step(s) ({snap['from']}), in this node's and a buddy "
                 f"node's host memory; a restart reads them when newer than the checkpoint")
    loss = br.get("after_node_loss")
    if loss and loss["nodes"]:
        L.append(f"  after one node lost: {loss['nodes']} nodes, dp {loss['dp']}, global batch {loss['global_batch']}"
                 f"{' (split unevenly)' if loss.get('uneven_batch') else ''}, step {_fmt_s(loss['step_s'])}")
    elif loss:
        L.append(f"  after one node lost: nothing goes on ({'; '.join(loss['problems'])})")
    if br.get("timeouts"):  # detection < quorum < collective (plan/timeouts.py)
        from orchestrator.plan.timeouts import lines

        L.append("  failover timeouts:")
        lc = plan.spec.launcher
        L += ["  " + x for x in lines(br["timeouts"], lc.node_fail_wait_s if lc.name.value == "slurm" else None)]
        if plan.layout.dp_replicate > 1:  # in place: the rebuild that follows the abort (plan/goodput.rebuild_s)
            from orchestrator.plan.goodput import plan_rebuild_s
            from orchestrator.rundir import store_shards

            k = store_shards(plan.world_size, plan.spec.failover.store_shards)
            from orchestrator.plan.goodput import recompute

            redo = recompute(plan)
            L.append(f"  - then the new generation rebuilds its cross-copy groups through the job's store, {k} "
                     f"shard{'s' if k > 1 else ''} at once (failover.store_shards): ~{_fmt_s(plan_rebuild_s(plan))}, "
                     f"and finishes the step in flight from the survivors' kept gradients: the lost copy's "
                     f"{redo['lost_microbatches']} micro-batch(es) recomputed, {redo['microbatches']} a data rank "
                     f"through the copy's pipeline, and the all-reduce: ~{_fmt_s(redo['seconds'])} "
                     f"(the whole step: ~{_fmt_s(plan.step.wall_s)})")
    return L


def placement_lines(pl) -> list[str]:
    """The placement section of the report (plan.md, the job's log)."""
    L = ["", f"placement on this allocation (topology: {pl.source}; {len(pl.nodes)} hosts)",
         f"  {'axis':<4} {'plan assumed':<14} {'spans here':<14}"]
    L += [f"  {a:<4} {pl.ideal[a]:<14} {t:<14}" for a, t in pl.tiers.items()]
    if pl.step_s is not None:
        L.append(f"  predicted step here {pl.step_s:.4g} s (plan {pl.ideal_step_s:.4g} s, "
                 f"{pl.step_s / pl.ideal_step_s - 1:+.1%}); hosts in name order {pl.name_order_step_s:.4g} s")
    shown = ", ".join(f"{k}:{h}" for k, h in enumerate(pl.nodes[:16]))
    return L + [f"  logical node -> host: {shown}{', ...' if len(pl.nodes) > 16 else ''}"]


def render_table(plan) -> str:
    return "\n".join(_lines(plan))


def command_line(command: list[str] | None) -> str | None:
    """The command as a shell would take it back: `orchestrate key=value ...`."""
    if command is None:
        return None
    import shlex

    argv = list(command)
    if not argv or not argv[0].rsplit("/", 1)[-1].startswith("orchestrat"):  # orchestrate, orchestrate-runs
        argv = ["orchestrate", *argv]
    return shlex.join(argv)


def render_markdown(plan, command: list[str] | None = None, overrides: list[str] | None = None,
                    figures: bool = True) -> str:
    """plan.md: the verdict, the exact command and its overrides, the table, the pictures."""
    sp, d = plan.spec, plan.layout
    title = "# Plan" + (f": {sp.model.name} on {plan.world_size:,} x {sp.hardware.name}" if sp else "") + \
        (f", {d.label()}" if d else "")
    out = [title, "", "**valid**" if plan.valid else "**REJECTED**", ""]
    line = command_line(command)
    if line is not None:
        if overrides is None:
            overrides = [a for a in command if "=" in a and not a.startswith("-")]
        out += ["## Command", "", "```bash", line, "```", ""]
        out += (["Overrides (on top of conf/config.yaml's defaults):", ""] + [f"- `{o}`" for o in overrides]
                if overrides else ["No overrides: conf/config.yaml's defaults."]) + [""]
    out += ["## Prediction", "", "```", "\n".join(_lines(plan)), "```", ""]
    if plan.valid and figures:
        out += ["## Pictures", "", "![cluster](cluster.png)", "", "![step budget](step_budget.png)", ""]
    return "\n".join(out)


MEASURED_START, MEASURED_END = "<!-- measured: start -->", "<!-- measured: end -->"


def render_measured(rows: list[dict], device: str = "cuda", parts: list[dict] | None = None) -> str:
    """plan.md's measured-vs-predicted section, one row per attempt (a failover re-plans), and
    with `parts` (rundir.metrics.measured_parts) the profiled step's parts against the plan's."""
    out = [MEASURED_START, "## Measured vs predicted", "",
           "| attempt | layout | steps | measured step (median, p10-p90) | predicted step | measured / predicted "
           "| MFU measured / predicted | tokens/s measured | loss first -> last |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = (f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}" if r.get("loss_first") is not None else "-")
        out.append(f"| {r['attempt']} | {r['layout']} | {r['steps']} (+{r['warmup_steps']} warm-up) | "
                   f"{_fmt_s(r['median_s'])} ({_fmt_s(r['p10_s'])}-{_fmt_s(r['p90_s'])}) | "
                   f"{_fmt_s(r['predicted_s'])} | {r['ratio']:.2f}x | "
                   f"{_fmt_pct(r['measured_mfu'])} / {_fmt_pct(r['predicted_mfu'])} | "
                   f"{r['tokens_per_s']:,.0f} | {loss} |")
    last = rows[-1]
    verdict = ("within 2x of the prediction" if 0.5 <= last["ratio"] <= 2.0 else
               "more than 2x off the prediction: refit with orchestrate-calibrate on this run")
    out += ["", f"The measured step is {last['ratio']:.2f}x the predicted one ({verdict}); the prediction rests "
                f"on hardware={last['hardware']} at kernel efficiency {last['kernel_efficiency']:.3g}. "
                f"Step times: metrics.jsonl (the first step of each attempt is warm-up, left out)."]
    if parts:
        step = parts[-1]
        out += ["", f"### Per part of the step (profiled step {step.get('profiled_step')}, rank 0)", "",
                "| part | predicted | measured | measured / predicted | profiler regions |", "|---|---|---|---|---|"]
        for p in parts:
            ratio = f"{p['measured_s'] / p['predicted_s']:.2f}x" if p["predicted_s"] > 0 else "-"
            regions = "-" if p["regions"] is None else str(p["regions"])
            out.append(f"| {p['part']} | {_fmt_s(p['predicted_s'])} | {_fmt_s(p['measured_s'])} | {ratio} | "
                       f"{regions} |")
        out += ["", "Measured by torch.profiler over one step (train/profile.py; it and its warm-up step are "
                    "left out of the step times): each collective part is the wall time of its outermost "
                    "regions (tp: DTensor redistributes; dp: FSDP2's gathers and reduce-scatters; pp: sends "
                    "and receives, with the bubble; cp: the attention's K/V gathers with their wait, and the other c10d collectives), compute the rest."]
    if device == "cpu":
        out += ["", "On a CPU preset the kernel efficiency is fitted to demo runs on one machine: it lumps Python, "
                    "gloo and scheduling overhead with the arithmetic, so the prediction means this machine's speed "
                    "on runs like the demo, not a GPU's."]
    return "\n".join(out + ["", MEASURED_END, ""])


def _fmt_pct(x: float | None) -> str:
    """43.1%, or two significant digits (0.18%) where one decimal would print 0.2% or 0.0%."""
    if x is None:
        return "-"
    return f"{x:.1%}" if x >= 0.01 else f"{x * 100:.2g}%"

"""Where one step's time went, measured: torch.profiler over one step on rank 0, its host
time split into the parts the plan predicts (rundir.PROFILE_JSON in the run directory).

The profiler records the ops and regions the runtime's libraries already name; each part is
the wall time of its outermost regions on the step's thread (nested ones counted once):

- tp: DTensor's redistributes (`Redistribute`, sequence-parallel gathers and reduce-scatters
  with their dispatch) and any functional collective outside them (loss_parallel's reductions);
- dp: FSDP2's regions (`FSDP::pre_forward`, `FSDP::all_gather`, `FSDP::post_backward_reduce`, ...:
  the gathers, copies and gradient reduce-scatters of the sharded state);
- pp: point-to-point sends and receives and the waits on them (the pipeline's bubble and transfers);
- cp: the attention's K/V gathers and their gradients' all-reduces (`_GatherSeq` forward and
  backward, model.py: the c10d op only enqueues the work, the wait for it is in these regions),
  and the other c10d collectives (the step's one loss all-reduce; without CP but with pipeline
  stages that all-reduce is where the first stage waits for the pipeline to drain, so it counts
  as pp);
- compute: the rest of the step (the model's ops, autograd, the optimizer).

It costs one warm-up step of the profiler and one profiled step, the last two of the run (their
metrics records say `profiled`, and the measured step leaves them out); runs of fewer than
PROFILE_MIN_STEPS steps are not profiled.
"""
from __future__ import annotations

from pathlib import Path

PROFILE_MIN_STEPS = 5
STEP_REGION = "orch::step"
PARTS = ("compute", "tp", "cp", "dp", "pp")
CP_REGIONS = ("_GatherSeq", "_GatherSeqBackward")  # model.py's autograd function, forward and backward


def profiled_steps(steps: int) -> tuple[int, int] | None:
    """(warm-up step, profiled step), or None when the run is too short to spare them."""
    return (steps - 2, steps - 1) if steps >= PROFILE_MIN_STEPS else None


def part_of(name: str) -> str | None:
    if name.startswith("FSDP::"):
        return "dp"
    if name in ("Redistribute", "NestedRedistribute") or name.startswith("_c10d_functional::"):
        return "tp"
    if name.startswith(("c10d::send", "c10d::recv", "c10d::batch_isend_irecv")) or "P2P" in name:
        return "pp"
    if name.startswith("c10d::") or name.startswith("gloo:") or name in CP_REGIONS:
        return "cp"
    return None


def summarize(events, lay: dict | None = None) -> dict:
    """Parts of the step region from the profiler's events (FunctionEvent: name, time_range,
    thread, cpu_parent); seconds, and the outermost region count of each part."""
    step = next((e for e in events if e.name == STEP_REGION), None)
    if step is None:
        return {}
    secs = {p: 0.0 for p in PARTS}
    calls = {p: 0 for p in PARTS}
    lo, hi = step.time_range.start, step.time_range.end
    for e in events:
        part = part_of(e.name)
        if part is None or e.thread != step.thread or not (lo <= e.time_range.start <= hi):
            continue
        parent, outer = e.cpu_parent, True
        while parent is not None:
            if part_of(parent.name) is not None:
                outer = False
                break
            parent = parent.cpu_parent
        if outer:
            secs[part] += (e.time_range.end - e.time_range.start) * 1e-6
            calls[part] += 1
    if lay and lay.get("pp", 1) > 1 and lay.get("cp", 1) == 1:
        secs["pp"], secs["cp"] = secs["pp"] + secs["cp"], 0.0
        calls["pp"], calls["cp"] = calls["pp"] + calls["cp"], 0
    step_s = (hi - lo) * 1e-6
    secs["compute"] = max(step_s - sum(secs.values()), 0.0)
    return {"step_s": step_s, "parts_s": secs, "regions": calls}


class StepProfiler:
    """Profile `training.steps - 1` on this rank (after one warm-up step) into PROFILE_JSON."""

    def __init__(self, run_dir: Path, steps: int, enabled: bool, lay: dict | None = None):
        self.run_dir, self.steps = Path(run_dir), profiled_steps(steps) if enabled else None
        self.lay = lay
        self.prof = None

    def profiled(self, step: int) -> bool:
        return self.steps is not None and step in self.steps

    def run(self, step: int, fn):
        if not self.profiled(step) or (step == self.steps[1] and self.prof is None):
            return fn()
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        if self.prof is None:  # the warm-up step (a step redone after a re-form: still the one profiler)
            self.prof = profile(activities=[ProfilerActivity.CPU], schedule=torch.profiler.schedule(
                wait=0, warmup=1, active=1, repeat=1))
            self.prof.__enter__()
        with record_function(STEP_REGION):
            out = fn()
        self.prof.step()
        if step == self.steps[1]:
            self.prof.__exit__(None, None, None)
            from orchestrator import rundir

            got = summarize(self.prof.events(), self.lay)
            if got:
                rundir.write_json(self.run_dir / rundir.PROFILE_JSON, dict(got, step=step), indent=1)
            self.prof = None
        return out

"""The plan's goodput prediction (plan.md's blast-radius section prints it)."""
from __future__ import annotations


def goodput(plan) -> dict:
    """The predicted effective training time ratio (ETTR): checkpoint writes and the time each
    failure costs, at the job's MTBF (hardware.failures_per_gpu_hour). With copies of the state
    and failover.in_place a failure costs the wait for a silent peer (failover.timeout_s, the worst
    case; a crash is seen sooner) and the step in flight redone; otherwise a restart from the last
    checkpoint: half the Young/Daly interval redone, and the checkpoint read back.
    benchmarks/failover_sim.py replays Llama 3's failure mix against this."""
    br, fo = plan.blast_radius, plan.spec.failover
    step_s = plan.step.wall_s
    in_place = br["replicas"] > 1 and fo.enabled and fo.in_place and plan.layout.ep == 1
    every = br["checkpoint_interval_s"]
    if not every:
        return {"in_place": in_place, "lost_per_failure_s": 0.0, "predicted_ettr": 1.0}
    lost = fo.timeout_s + step_s if in_place else every / 2 + br["checkpoint_seconds"]
    mtbf_s = br["job_mtbf_hours"] * 3600.0
    ettr = (1 - br["checkpoint_seconds"] / every) * max(0.0, 1 - lost / mtbf_s)
    return {"in_place": in_place, "lost_per_failure_s": lost, "predicted_ettr": ettr}

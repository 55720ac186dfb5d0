"""Measured against predicted: the one formula for a measured MFU."""
from __future__ import annotations


def measured_mfu(plan_json: dict, step_s: float) -> float:
    """Model FLOPs of one step over (GPUs x peak x the measured step time)."""
    peak = plan_json["config"]["hardware"]["peak_tflops"] * 1e12
    return plan_json["model_flops_per_step"] / (plan_json["world_size"] * peak * step_s)

"""One rank of a training job: `python -m orchestrator.train.worker RUN_DIR`.

Reads RUN_DIR/plan.json (never re-derives the layout), its place from the usual
torch environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
builds the plan's mesh, model parts, optimizer and schedule, and trains.
Rank 0 writes TensorBoard events and metrics.json into RUN_DIR; the leader of
each data-parallel replica records the sample indices it read (samples/).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from orchestrator.train.data import TokenSource
from orchestrator.train.mesh import grid_from_json, mesh_from_grid
from orchestrator.train.model import cp_shard
from orchestrator.train.parallel import MULTI_STAGE, build_model_parts, build_schedule


def _ns(d):
    return SimpleNamespace(**{k: _ns(v) for k, v in d.items()}) if isinstance(d, dict) else d


def _scalar(x) -> float:
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x.detach())


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class Logger:
    """Console line per log interval and TensorBoard scalars, on rank 0 only."""

    def __init__(self, run_dir: Path, plan: dict, enabled: bool):
        self.enabled = enabled
        self.plan = plan
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            md = run_dir / "plan.md"
            if md.exists():
                self.writer.add_text("plan", md.read_text().replace("\n", "  \n"), 0)

    def step(self, step: int, steps: int, values: dict, line: bool):
        if not self.enabled:
            return
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        if line:
            eta = values["time/step_s"] * (steps - step - 1)
            print(f"step {step + 1}/{steps} | loss {values['loss/train']:.4f} | {values['time/step_s']:.3f} s/step | "
                  f"{values['throughput/tokens_per_s']:,.0f} tok/s | MFU {values['perf/mfu']:.2%} "
                  f"(plan {values['perf/mfu_predicted']:.2%}) | ETA {eta:.0f} s", flush=True)

    def close(self):
        if self.writer:
            self.writer.flush()
            self.writer.close()


def train(run_dir: Path) -> dict:
    plan = json.loads((run_dir / "plan.json").read_text())
    cfg = _ns(plan["config"])
    lay = plan["layout"]
    hw, tr = cfg.hardware, cfg.training
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != plan["world_size"]:
        raise SystemExit(f"the job has WORLD_SIZE {world} but the plan needs {plan['world_size']} "
                         f"(cluster.nodes x hardware.gpus_per_node); re-plan for this allocation")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if hw.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group(hw.backend)
    grid = grid_from_json(plan)
    mesh = mesh_from_grid(grid, device.type)
    coords = grid.coords(rank)
    tp, cp, pp, m = lay["tp"], lay["cp"], lay["pp"], lay["microbatches"]
    mp = None
    if tr.precision == "bf16" and device.type == "cuda":  # CPU runs in fp32: bf16 there is emulated
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parts = build_model_parts(cfg.model, lay, mesh, coords, tr.seed, loss_parallel=tp > 1, device=device, mp=mp)
    params = [p for _, part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=tr.lr, betas=(0.9, 0.95), eps=getattr(tr, "adam_eps", 1e-8),
                            weight_decay=0.0)
    schedule = None
    ids = [i for i, _ in parts]
    n_stages = pp * (lay["vp"] if lay["schedule"] in MULTI_STAGE else 1)
    if pp > 1:
        schedule, _ = build_schedule(parts, lay, mesh, device, loss_fn, m)
    has_first, has_last = 0 in ids, (n_stages - 1) in ids
    data = TokenSource(cfg.model.vocab, tr.seq_len, tr.seed, getattr(tr, "data", None))
    dp_total = lay["dp"]
    dp_rank = coords["dp"] * grid.sizes["ep"] + coords["ep"]
    b = tr.micro_batch
    record = tp == 1 or coords["tp"] == 0
    record = record and coords["cp"] == 0 and has_first
    samples_dir = run_dir / "samples"
    samples_dir.mkdir(exist_ok=True)
    log = Logger(run_dir, plan, rank == 0)
    ctx = loss_parallel if tp > 1 else contextlib.nullcontext
    peak = hw.peak_tflops * 1e12
    tokens_per_step = tr.global_batch * tr.seq_len
    history = {"loss": [], "step_time_s": []}
    start_step = int(os.environ.get("ORCH_START_STEP", "0"))
    for step in range(start_step, tr.steps):
        idx = data.indices(step, tr.global_batch, dp_total, dp_rank)
        tokens = data.batch(idx).to(device)
        inputs, labels = cp_shard(tokens[:, :-1], cp, coords["cp"]), cp_shard(tokens[:, 1:], cp, coords["cp"])
        if record:
            with open(samples_dir / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "dp_rank": dp_rank, "indices": idx}) + "\n")
        t0 = time.perf_counter()
        local = None
        with ctx():
            if schedule is not None:
                losses: list = []
                args = (inputs,) if has_first else ()
                kw = {"target": labels, "losses": losses} if has_last else {}
                schedule.step(*args, **kw)
                if has_last:
                    local = sum(_scalar(x) for x in losses) / len(losses)
            else:
                model = parts[0][1]
                local = 0.0
                for k in range(m):
                    x, y = inputs[k * b:(k + 1) * b], labels[k * b:(k + 1) * b]
                    loss = loss_fn(model(x), y) / m
                    loss.backward()
                    local += _scalar(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The mean over every rank that computed a loss (all TP ranks of the last stage agree).
        agg = torch.tensor([local or 0.0, 1.0 if local is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(agg)
        mean_loss = (agg[0] / agg[1]).item()
        dt = time.perf_counter() - t0
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        history["loss"].append(mean_loss)
        history["step_time_s"].append(dt)
        mfu = plan["model_flops_per_step"] / (world * peak * dt)
        log.step(step, tr.steps, {
            "loss/train": mean_loss, "time/step_s": dt, "throughput/tokens_per_s": tokens_per_step / dt,
            "perf/tflops_per_gpu": mfu * hw.peak_tflops, "perf/tflops_per_gpu_predicted": plan["tflops_per_gpu"],
            "perf/mfu": mfu, "perf/mfu_predicted": plan["mfu"], "time/step_s_predicted": plan["step"]["wall_s"],
            "memory/max_rss_mb": float(rss.item()),
        }, line=(step + 1) % max(tr.log_every, 1) == 0 or step + 1 == tr.steps)
    log.close()
    if rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps({
            "loss": history["loss"], "step_time_s": history["step_time_s"], "start_step": start_step,
            "layout": {k: lay[k] for k in ("tp", "cp", "pp", "dp", "vp", "schedule")},
        }, indent=1))
    dist.barrier()  # DCP and gloo exit cleanly only after everyone is done (torch-cpu notes)
    dist.destroy_process_group()
    return history


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m orchestrator.train.worker RUN_DIR")
    train(Path(sys.argv[1]))


if __name__ == "__main__":
    main()

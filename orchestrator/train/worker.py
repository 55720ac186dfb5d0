"""One rank of a training job: `python -m orchestrator.train.worker PLAN_DIR`.

Reads PLAN_DIR/plan.json (never re-derives the layout), its place from the usual
torch environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
builds the plan's mesh, model parts, optimizers and schedule, resumes from the
latest complete checkpoint if there is one (resharding it into this layout),
and trains. Outputs go to ORCH_RUN_DIR (default PLAN_DIR), shared by every
attempt of a run: rank 0 writes TensorBoard events, metrics.json (this attempt)
and metrics.jsonl (every step of every attempt); the leader of each data-parallel
replica records the sample indices it read (samples/).
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

from orchestrator.train import checkpoint as ckpt
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


def train(plan_dir: Path, should_stop=None) -> dict:
    """Train on the plan in plan_dir. `should_stop()` (SLURM preemption) is polled at
    every step boundary; when any rank says so, all save a checkpoint and return."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    run_dir = Path(os.environ.get("ORCH_RUN_DIR", plan_dir))
    attempt = int(os.environ.get("ORCH_ATTEMPT", "0"))
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
    parts = build_model_parts(cfg.model, lay, mesh, coords, tr.seed, loss_parallel=tp > 1, device=device, mp=mp,
                              recompute=tr.recompute)
    # One optimizer per model part (virtual stage), as torchtitan does: each part's
    # state dict then holds exactly its own parameters' names.
    opts = [torch.optim.AdamW(part.parameters(), lr=tr.lr, betas=(0.9, 0.95), eps=getattr(tr, "adam_eps", 1e-8),
                              weight_decay=0.0) for _, part in parts]
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
    url = ckpt.url_for(tr.checkpoint.dir, run_dir)
    start_step = 0
    latest = ckpt.latest_complete(url)
    if latest is not None:
        meta = ckpt.read_meta(url, latest)
        problems = ckpt.compatibility_problems(meta, plan["config"]["model"], plan["config"]["training"])
        if problems:
            raise SystemExit("cannot resume: " + "; ".join(f"[{k}] {m}" for k, m in problems) +
                             ". Fix: point training.checkpoint.dir elsewhere, or set "
                             "training.resume.allow_batch_change=true for a batch change.")
        t_load = time.perf_counter()
        ckpt.load(url, latest, parts, opts)
        start_step = meta["step"]
        if os.environ.get("ORCH_DUMP_AFTER_LOAD"):
            _dump_full_state(Path(os.environ["ORCH_DUMP_AFTER_LOAD"]), rank, parts, opts)
        if rank == 0:
            print(f"resumed from {ckpt.step_dir(url, latest)} (step {latest}, layout "
                  f"TP{meta['layout']['tp']} CP{meta['layout']['cp']} PP{meta['layout']['pp']} "
                  f"DP{meta['layout']['dp']} -> TP{tp} CP{cp} PP{pp} DP{lay['dp']}) in "
                  f"{time.perf_counter() - t_load:.2f} s", flush=True)
    if latest is not None and "rng_state" in meta:
        import base64

        import numpy as np

        buf = np.frombuffer(base64.b64decode(meta["rng_state"]), dtype=np.uint8).copy()
        torch.random.set_rng_state(torch.from_numpy(buf))  # every rank continues rank 0's stream
    else:
        torch.manual_seed(tr.seed + start_step)
    fault = _fault_hook(rank, grid, plan)
    ctx = loss_parallel if tp > 1 else contextlib.nullcontext
    peak = hw.peak_tflops * 1e12
    tokens_per_step = tr.global_batch * tr.seq_len
    history = {"loss": [], "step_time_s": []}
    every = tr.checkpoint.every
    pending = None
    ckpt_group = dist.new_group(backend="gloo") if every and tr.checkpoint.async_save else None
    for step in range(start_step, tr.steps):
        idx = data.indices(step, tr.global_batch, dp_total, dp_rank)
        tokens = data.batch(idx).to(device)
        inputs, labels = cp_shard(tokens[:, :-1], cp, coords["cp"]), cp_shard(tokens[:, 1:], cp, coords["cp"])
        if record:
            with open(samples_dir / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "attempt": attempt, "dp_rank": dp_rank, "indices": idx}) + "\n")
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
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        # The mean over every rank that computed a loss (all TP ranks of the last stage agree).
        agg = torch.tensor([local or 0.0, 1.0 if local is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(agg)
        mean_loss = (agg[0] / agg[1]).item()
        dt = time.perf_counter() - t0
        rss_local = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
        if device.type == "cuda":
            rss_local[0] = torch.cuda.max_memory_allocated(device) / 2**20
        rss = [torch.zeros_like(rss_local) for _ in range(world)]
        dist.all_gather(rss, rss_local)
        history["loss"].append(mean_loss)
        history["step_time_s"].append(dt)
        mfu = plan["model_flops_per_step"] / (world * peak * dt)
        log.step(step, tr.steps, {
            "loss/train": mean_loss, "time/step_s": dt, "throughput/tokens_per_s": tokens_per_step / dt,
            "perf/tflops_per_gpu": mfu * hw.peak_tflops, "perf/tflops_per_gpu_predicted": plan["tflops_per_gpu"],
            "perf/mfu": mfu, "perf/mfu_predicted": plan["mfu"], "time/step_s_predicted": plan["step"]["wall_s"],
            "memory/max_rss_mb": max(float(x) for x in rss),
            # per rank (peak host RSS on CPU, peak allocated device memory on GPU), the first 64 ranks
            **{f"memory/rank{r}_mb": float(x) for r, x in enumerate(rss[:64])},
        }, line=(step + 1) % max(tr.log_every, 1) == 0 or step + 1 == tr.steps)
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": mean_loss, "step_time_s": dt, "attempt": attempt,
                                    "dp": lay["dp"], "time": time.time()}) + "\n")
        if every and ((step + 1) % every == 0 or step + 1 == tr.steps):
            meta = _meta(plan, step + 1)
            if pending is not None:
                pending.finish()
            pending = ckpt.save(url, step + 1, parts, opts, meta, rank, keep=tr.checkpoint.keep,
                                fault_hook=fault if fault and step + 1 == fault.step else None,
                                asynchronous=tr.checkpoint.async_save, group=ckpt_group)
            if not tr.checkpoint.async_save:
                pending = None
        if should_stop is not None and step + 1 < tr.steps:
            flag = torch.tensor([1.0 if should_stop() else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                if pending is not None:
                    pending.finish()
                    pending = None
                if ckpt.latest_complete(url) != step + 1:
                    ckpt.save(url, step + 1, parts, opts, _meta(plan, step + 1), rank, keep=tr.checkpoint.keep)
                if rank == 0:
                    print(f"stopping after step {step + 1} on request (preemption or time limit); checkpoint "
                          f"saved", flush=True)
                history["stopped"] = True
                break
    if pending is not None:
        pending.finish()
    log.close()
    if rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps({
            "loss": history["loss"], "step_time_s": history["step_time_s"], "start_step": start_step,
            "attempt": attempt,
            "layout": {k: lay[k] for k in ("tp", "cp", "pp", "dp", "vp", "schedule")},
        }, indent=1))
    dist.barrier()  # DCP and gloo exit cleanly only after everyone is done (torch-cpu notes)
    dist.destroy_process_group()
    return history


def _meta(plan: dict, next_step: int) -> dict:
    """What a checkpoint records besides tensors: the data position, RNG state, shape, batch and plan."""
    import base64

    tr, lay = plan["config"]["training"], plan["layout"]
    rng = base64.b64encode(torch.random.get_rng_state().numpy().tobytes()).decode()
    return {"step": next_step, "rng_state": rng, "samples_consumed": next_step * tr["global_batch"],
            "model": plan["config"]["model"],
            "training": {k: tr[k] for k in ("global_batch", "seq_len", "seed")},
            "layout": {k: lay[k] for k in ("tp", "cp", "pp", "dp", "vp", "schedule")}, "plan": plan}


def _dump_full_state(out: Path, rank: int, parts, opts) -> None:
    """Tests: this rank's parts as full (unsharded) tensors, to compare with the checkpoint."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    o = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model, optim = {}, {}
    for (_, part), opt in zip(parts, opts):
        model.update(get_model_state_dict(part, options=o))
        optim.update(get_optimizer_state_dict(part, opt, options=o))
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "optim": optim}, out / f"rank{rank}.pt")


class _Fault:
    """Fault injection (fault.mode=during_save): every rank of the victim node kills
    itself in the middle of the save at `step`, as a node would die."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self):
        import signal

        print(f"fault injection: killing this node during the save of step {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _fault_hook(rank: int, grid, plan: dict):
    if os.environ.get("ORCH_FAULT_MODE") != "during_save":
        return None
    node = rank // plan["config"]["hardware"]["gpus_per_node"]
    if node != int(os.environ["ORCH_FAULT_NODE"]):
        return None
    return _Fault(int(os.environ["ORCH_FAULT_STEP"]))


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m orchestrator.train.worker PLAN_DIR")
    train(Path(sys.argv[1]))


if __name__ == "__main__":
    main()

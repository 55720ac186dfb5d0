"""A plain-torch training script that orchestrate launches with trainer=command:

    orchestrate hardware=cpu cluster.nodes=2 hardware.gpus_per_node=2 model=tiny \
        training.steps=12 training.global_batch=8 training.checkpoint.every=2 launcher=local \
        trainer=command trainer.command='python examples/train_fsdp.py --lr 3e-3'

FSDP2 over the plan's data-parallel group (orchestrator.runtime.device_mesh()["dp"]), a
small language model of the plan's vocabulary and width, DCP checkpoints in the run
directory (RUN_DIR/checkpoints/step_NNNNNNNN/, COMPLETE written last) and resume from the
newest complete one, so a relaunch after a lost node (on fewer ranks: DCP reshards) goes on
where it left off. SIGUSR2 or SIGTERM (SLURM: time limit, preemption) makes every rank save at
the next step boundary and exit with status 3: the job requeues and resumes from that save.
The data is synthetic and keyed by step: every layout sees the same global
batch at the same step, so a resumed run has the losses of an uninterrupted one. Rank 0
appends {"step", "loss", "attempt", "dp"} to RUN_DIR/metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from orchestrator import runtime


def model_for(cfg: dict) -> torch.nn.Module:
    m = cfg["model"]
    vocab, width = min(m["vocab"], 512), min(m["hidden"], 64)
    torch.manual_seed(cfg["training"]["seed"])  # the same initial weights on every rank and attempt
    return torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width),
                               torch.nn.Linear(width, vocab))


def batch(step: int, cfg: dict, vocab: int) -> torch.Tensor:
    """The global batch of `step`: a function of the seed and the step only."""
    tr = cfg["training"]
    g = torch.Generator().manual_seed(tr["seed"] * 1_000_003 + step)
    first = torch.randint(0, vocab, (tr["global_batch"], 1), generator=g)
    steps = torch.arange(min(tr["seq_len"], 32) + 1)
    return (first * 5 ** steps + 7 * steps) % vocab  # a rule the model can learn: x[t+1] = f(x[t])


def latest(ckpt: str) -> int | None:
    steps = [int(d.removeprefix("step_")) for d in os.listdir(ckpt) if d.startswith("step_")
             and os.path.exists(f"{ckpt}/{d}/COMPLETE")] if os.path.isdir(ckpt) else []
    return max(steps, default=None)


EXIT_STOPPED = 3  # saved on request: the SLURM supervisor requeues the job (orchestrator/launch/srun.py)


def save(model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        open(f"{path}/COMPLETE", "w").close()  # written last: only complete saves are resumed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    plan = runtime.plan()
    cfg, lay = plan["config"], plan["layout"]
    if lay["tp"] * lay["cp"] * lay["pp"] != 1:
        raise SystemExit(f"this example shards over data parallelism only; the plan has {lay['label']}")
    device = cfg["hardware"]["device"]  # cpu (gloo) or cuda (NCCL): one GPU per rank, LOCAL_RANK's
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = runtime.device_mesh()
    dp = mesh["dp"]
    model = model_for(cfg).to(device)
    vocab = model[0].num_embeddings
    for layer in (model[1], model[3], model[5]):
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
    tr = cfg["training"]
    ckpt = tr["checkpoint"]["dir"] or str(runtime.run_dir() / "checkpoints")
    start = latest(ckpt) or 0
    if start:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{ckpt}/step_{start:08d}")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        print(f"resumed from step {start} ({ckpt})", flush=True)
    stop = torch.zeros(1)
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.fill_(1))
    rank, per = dp.get_local_rank(), tr["global_batch"] // dp.size()
    for step in range(start, tr["steps"]):
        tokens = batch(step, cfg, vocab)[rank * per:(rank + 1) * per].to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # FSDP averages the gradients over dp: the global batch's mean
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp.get_group())
        mean = float(mean) / dp.size()
        if dist.get_rank() == 0:
            with open(runtime.run_dir() / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": mean, "attempt": runtime.attempt(), "dp": dp.size(),
                                    "time": time.time()}) + "\n")
            print(f"step {step + 1}/{tr['steps']} | loss {mean:.6f}", flush=True)
        every, asked = tr["checkpoint"]["every"], stop.clone()
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)  # any rank signalled: all save at this boundary
        if asked.item() or (every and ((step + 1) % every == 0 or step + 1 == tr["steps"])):
            save(model, opt, f"{ckpt}/step_{step + 1:08d}")
        if asked.item() and step + 1 < tr["steps"]:
            print(f"stopping after step {step + 1}: saved, the job resumes from here", flush=True)
            leave(EXIT_STOPPED)
    leave(0)


def leave(code: int) -> None:
    """Everyone done (the save is on disk), then out without the interpreter's teardown: a gloo or
    store thread torn down while a late signal lands can abort the process ('terminate called without
    an active exception', status 134), and the exit status is what tells SLURM to requeue."""
    dist.barrier()  # gloo and DCP exit cleanly only after everyone is done
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

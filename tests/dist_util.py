"""Run a function on N real processes with gloo (one per emulated GPU)."""
from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from orchestrator.launch.processes import free_port


def _entry(rank, fn, world, port, args, errq):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # done: out without the interpreter's teardown, which can abort a rank that finished its work
    # ('terminate called without an active exception': gloo's threads; about 1 run in 10 of
    # tests/fsdp2_bytes.py), as the runtime's ranks leave (orchestrator/rundir exit_now)
    from orchestrator.rundir import exit_now

    exit_now(0)


def run_workers(fn, world: int, *args):
    """Spawn `world` processes running fn(rank, world, *args); raise with every rank's error."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(fn, world, free_port(), args, errq), nprocs=world, start_method="spawn")
    except Exception as e:
        errs = []
        while not errq.empty():
            errs.append(errq.get())
        raise AssertionError("worker(s) failed:\n" + "\n".join(f"rank {r}:\n{t}" for r, t in errs)) from e

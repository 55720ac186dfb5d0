"""Measure this machine's components and write a site preset (`orchestrate-calibrate --probe`).

The `cpu` preset's step is one fitted factor (kernel_efficiency) that says nothing about which
part of a step is slow. The probe measures the parts the shape-aware kernel model and the
collective model need, on this machine, in processes set up as the runtime's ranks are
(OMP_NUM_THREADS=1, gloo over loopback):

- GEMM rate: fp32 torch.matmul at square shapes 64-512 (best rate -> `peak_tflops`, with
  `gemm_efficiency` 1: the model's GEMM roofline is then the measured rate);
- memory bandwidth: a 32 MB tensor copy (read + write) -> `hbm_gbps`;
- per-op overhead: forward and backward of a 16-element op through autograd (printed), and
  the runtime's own transformer block (model=tiny) forward and backward over the kernels the
  shape model counts for it -> `launch_overhead_us` (module calls, autograd and Python
  between ops, which decide a tiny model's step);
- gloo all-reduce between `ranks` local processes: 8 bytes (latency -> the tiers' latency)
  and 4 MB (bus bandwidth 2 (n-1)/n bytes / time -> the tiers' GB/s);
- each collective call as the runtime issues it, between pieces of work, at the tiny model's
  sizes (runtime_calls: DTensor redistribute, a DTensor op's extra dispatch, plain c10d calls,
  FSDP2's per-unit gathers and reduce-scatter) -> `tp_call_us`, `dtensor_op_us`, `c10d_call_us`,
  `fsdp_gather_us`, `fsdp_reduce_us` (plan/overheads.py counts the calls per layout);
- the cores' worth the ranks get (`host_cores`): the same work in `ranks` processes at once
  against one alone, so other load on a shared host counts (ranks beyond it share the time).

torch is imported here only: `import orchestrator` and the planner stay torch-free.
"""
from __future__ import annotations

import os
import socket
import time


CALL_KEYS = ("tp_call_us", "dtensor_op_us", "c10d_call_us", "fsdp_gather_us", "fsdp_reduce_us")


def _best(fn, repeat: int = 5, number: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t) / number)
    return best


def _work() -> None:
    """A fixed slice of CPU work (small matmuls and elementwise ops, as a tiny model's step)."""
    import torch

    a = torch.randn(64, 64)
    for _ in range(200):
        a = torch.tanh(a @ a * 0.01)


def local_components() -> dict:
    import torch

    torch.set_num_threads(1)
    gemm = {}
    for n in (64, 128, 256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        gemm[n] = 2.0 * n ** 3 / _best(lambda: torch.mm(a, b), number=max(1, 2 ** 24 // n ** 3)) / 1e12
    x, y = torch.empty(8 << 20), torch.randn(8 << 20)
    hbm = 2 * 4 * x.numel() / _best(lambda: x.copy_(y)) / 1e9
    w = torch.randn(16, requires_grad=True)

    def ops():
        z = w
        for _ in range(50):
            z = z * 1.0001
        z.sum().backward()

    per_op = _best(ops, number=4) / 101 * 1e6  # 50 multiplies + the sum, forward and backward
    return {"gemm_tflops": gemm, "hbm_gbps": hbm, "op_overhead_us": per_op, "layer_op_us": layer_op_us(),
            "work_s": _best(_work, repeat=5, number=2)}


def layer_op_us() -> float:
    """Host time per counted kernel of the runtime's own transformer block (orchestrator/train,
    model=tiny, one micro-batch, forward and backward, one process): the block's measured time
    over the kernels the shape model counts for it. Module calls, autograd and Python between
    the ops are what a tiny model's step costs on a CPU, far above a bare op's dispatch."""
    import torch

    from orchestrator.config.compose import compose
    from orchestrator.plan.kernels import layer_features, shape_of
    from orchestrator.plan.model import ModelMath
    from orchestrator.plan.plan import plan_spec
    from orchestrator.train.model import Block

    torch.set_num_threads(1)  # as the runtime's ranks run (OMP_NUM_THREADS=1)
    spec = compose(["hardware=cpu", "model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=1",
                    "hardware.kernel_model=shape"])
    plan = plan_spec(spec)
    tr = spec.training
    count = layer_features(ModelMath(spec.model), False, shape_of(plan.layout, tr, spec.hardware, spec)).kernels * 1e6
    block = Block(spec.model, 0)
    x = torch.randn(tr.micro_batch, tr.seq_len, spec.model.hidden, requires_grad=True)
    return _best(lambda: block(x).sum().backward(), number=5) / count * 1e6


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    small, big = torch.zeros(2), torch.zeros(1 << 20)
    for _ in range(10):
        dist.all_reduce(small)
    dist.barrier()
    lat = _best(lambda: dist.all_reduce(small), repeat=5, number=40)
    bw_t = _best(lambda: dist.all_reduce(big), repeat=3, number=3)
    calls = runtime_calls(world)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(10):  # every rank at once, as a run's ranks compute
        _work()
    work = torch.tensor([(time.perf_counter() - t) / 10])
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(str(x) for x in (lat, bw_t, big.numel() * 4, *calls, float(work))))
    dist.barrier()
    dist.destroy_process_group()


def runtime_calls(world: int) -> tuple[float, float, float, float, float]:
    """Seconds per call of the collectives as the runtime issues them, at the tiny model's
    sizes (hidden 64, ffn 128, one 64-token micro-batch, fp32), each including its Python and
    dispatch around the wire, and each issued between pieces of work as the runtime issues them:
    ranks that computed arrive apart and gloo's threads wake, which costs several times a
    back-to-back call's latency on a loaded host: (DTensor redistribute, the mean of a sequence-parallel all-gather
    Shard(1) -> Replicate and reduce-scatter Partial -> Shard(1), as TP's layers run them;
    one DTensor op's host time above the plain op's (a small matmul); a plain c10d all-gather
    and all-reduce of a K/V-sized block, as context parallelism's attention runs them; FSDP2's
    per-unit gather for one micro-batch's forward and backward (fully_shard on a two-linear
    unit, reshard after forward, gradient sync off, minus the same unit unsharded); FSDP2's
    per-unit gradient reduce-scatter (the same step with gradient sync on, minus off))."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    seq, h = 64, 64
    w0 = torch.randn(h, h)

    def work():  # a layer's worth of ops between two calls, as the runtime has (its ranks drift apart)
        b = w0
        for _ in range(5):
            b = torch.tanh(b @ w0 * 0.01)

    alone = _best(work, repeat=5, number=20)

    def call(fn) -> float:
        """Seconds of one call issued between pieces of work, above the work alone."""
        return _best(lambda: (work(), fn()), repeat=5, number=20) - alone

    part = DTensor.from_local(torch.randn(1, seq // world, h), mesh, [Shard(1)], run_check=False)
    partial = DTensor.from_local(torch.randn(1, seq, h), mesh, [Partial()], run_check=False)
    ag = call(lambda: part.redistribute(mesh, [Replicate()]).to_local().sum())
    rs = call(lambda: partial.redistribute(mesh, [Shard(1)]).to_local().sum())
    a, w = torch.randn(seq, h), torch.randn(h, h)
    da = DTensor.from_local(a, mesh, [Replicate()], run_check=False)
    dw = DTensor.from_local(w, mesh, [Shard(1)], run_check=False)
    op = _best(lambda: torch.mm(da, dw), repeat=5, number=50) - _best(lambda: torch.mm(a, w), repeat=5, number=50)
    kv = torch.randn(1, seq // world, h)
    outs = [torch.empty_like(kv) for _ in range(world)]
    c10d = (call(lambda: dist.all_gather(outs, kv)) + call(lambda: dist.all_reduce(kv))) / 2
    units = 4

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(h, 2 * h), nn.Linear(2 * h, h)) for _ in range(units)])

    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the bare Sequential's output
    x = torch.randn(1, seq, h)
    plain = stack()
    sharded = stack()
    for u in sharded:
        fully_shard(u, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    base = _best(lambda: plain(x).sum().backward(), repeat=5, number=5)

    def fsdp(sync: bool):
        sharded.set_requires_gradient_sync(sync)
        sharded(x).sum().backward()

    gather = (_best(lambda: fsdp(False), repeat=5, number=5) - base) / (units + 1)
    reduce = (_best(lambda: fsdp(True), repeat=5, number=5) - base) / (units + 1) - gather
    return max((ag + rs) / 2, 0.0), max(op, 0.0), max(c10d, 0.0), max(gather, 0.0), max(reduce, 0.0)


def collectives(ranks: int = 2) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.txt")
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(_worker, args=(ranks, port, out), nprocs=ranks, join=True)
        lat, bw_t, nbytes, tp, op, c10d, gather, reduce, work = (float(x) for x in open(out).read().split())
    bus = 2.0 * (ranks - 1) / ranks * nbytes / bw_t / 1e9
    return {"ranks": ranks, "latency_us": lat * 1e6, "bus_gbps": bus, "tp_call_us": tp * 1e6,
            "dtensor_op_us": op * 1e6, "c10d_call_us": c10d * 1e6, "fsdp_gather_us": gather * 1e6,
            "fsdp_reduce_us": reduce * 1e6, "work_s": work}


def probe(ranks: int = 2) -> dict:
    out = local_components()
    out["gloo"] = collectives(ranks)
    # Once more after the collectives, the least disturbed of the two kept: on a shared host the
    # other load changes from second to second, and a run's fastest steps see its quiet moments.
    out["layer_op_us"] = min(out["layer_op_us"], layer_op_us())
    out["work_s"] = min(out["work_s"], _best(_work, repeat=5, number=2))
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # The cores the ranks really get: the same work in `ranks` processes at once against one alone
    # (other load on the host takes its share; ranks beyond these share their time).
    got = ranks * out["work_s"] / out["gloo"]["work_s"]
    # (at least one: the single-process figures above already carry the load one process sees)
    out["host_cores"] = round(min(float(allowed), max(got, 1.0)), 2) if got < ranks * 0.95 else float(allowed)
    out["cores_allowed"] = allowed
    return out


def site_preset(measured: dict, base: dict) -> dict:
    """The `cpu` preset (`base`) with the measured components in place of its rough figures."""
    g = measured["gloo"]
    # The calls were timed with the probe's ranks sharing the cores they got; the preset holds
    # them per uncontended core (the cost model scales them by each layout's own core share).
    shared = max(1.0, g["ranks"] / measured["host_cores"]) if measured["host_cores"] else 1.0
    hw = dict(base)
    hw.update(name="site", peak_tflops=round(max(measured["gemm_tflops"].values()), 6), gemm_efficiency=1.0,
              hbm_gbps=round(measured["hbm_gbps"], 3), intra_node_gbps=round(g["bus_gbps"], 3),
              inter_node_gbps=round(g["bus_gbps"], 3), intra_node_latency_us=round(g["latency_us"], 2),
              inter_node_latency_us=round(g["latency_us"], 2), kernel_model="shape",
              launch_overhead_us=round(measured.get("layer_op_us", measured["op_overhead_us"]), 3),
              host_cores=float(measured["host_cores"]),
              **{k: round(g.get(k, 0.0) / shared, 2) for k in CALL_KEYS})
    return hw

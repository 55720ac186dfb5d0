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
- gloo all-reduce within pairs of the `ranks` local processes, every pair at once: 8 bytes
  (latency -> the tiers' latency) and 4 MB (bus bandwidth 2 (n-1)/n bytes / time -> the tiers' GB/s);
- each collective call as the runtime issues it, over pairs of ranks, every pair at once,
  between pieces of work, at the tiny model's sizes (runtime_calls: a DTensor redistribute,
  a plain c10d call) -> `tp_call_us`,
  `c10d_call_us` (plan/overheads.py counts the calls per layout);
- the runtime's own model (model=tiny: its blocks, embedding, head and loss, one micro-batch
  forward and backward with the loss read as the trainer reads it) in every rank at once, plain,
  under TP (apply_tp, loss_parallel), under CP (apply_cp) and under FSDP2 (apply_fsdp, gradient
  sync off and on) over pairs of ranks, as two pipeline stages under torch's 1F1B
  (pipeline_calls), and an AdamW step over its parameters plain and as TP's DTensors
  (model_calls): what each costs above the plain model beyond the calls counted above is
  DTensor's dispatch per op (`dtensor_op_us`, over the kernels the shape model counts), CP's
  per collective as the attention issues it (`cp_call_us`), FSDP2's per unit and micro-batch
  (`fsdp_gather_us`) and per unit and step (`fsdp_reduce_us`), the schedule's per micro-batch
  (`pp_microbatch_us`) and the optimizer's per parameter tensor (`optimizer_us`,
  `dtensor_optimizer_us`);
- the cores' worth the ranks get (`host_cores`): the same work in `ranks` processes at once
  against one process alone, each timed the same way (_slowest; cores_now() measures it beside
  a run), so other load on a shared host counts (ranks beyond it share the time).

torch is imported here only: `import orchestrator` and the planner stay torch-free.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from functools import lru_cache


from orchestrator.plan.machine import CALL_KEYS, FSDP_GROUP, PROBE_GROUP
# The preset keys the probe measures directly and the raw figures each is (derive()'s `terms`
# adds the derived call costs, DERIVED_FROM; tp_call_us and c10d_call_us are timed as they are).
MEASURED_FROM = {
    "peak_tflops": ("gemm_tflops",), "hbm_gbps": ("hbm_gbps",), "launch_overhead_us": ("layer_op_us",),
    "intra_node_gbps": ("gloo.bus_gbps",), "inter_node_gbps": ("gloo.bus_gbps",),
    "intra_node_latency_us": ("gloo.latency_us",), "inter_node_latency_us": ("gloo.latency_us",),
    "host_cores": ("work_s", "work_together_s", "cores_allowed"),
    "tp_call_us": ("gloo.tp_call_us",), "c10d_call_us": ("gloo.c10d_call_us",),
}
# A probe's collective that waits longer than this fails the probe (a peer died or hangs), not the host
CALL_TIMEOUT_S = 300
PAIR = PROBE_GROUP  # every call and the runtime's model under TP, CP, FSDP2, PP: over pairs of the probe's ranks


def tiny_spec(*overrides: str):
    """The typed config of the runtime's tiny model on hardware=cpu, as every measurement here builds it."""
    from orchestrator.config.compose import compose, typed

    return typed(compose(["hardware=cpu", "model=tiny", *overrides]))


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
            "work_s": _slowest(1)}


def layer_op_us() -> float:
    """Host time per counted kernel of the runtime's own transformer block (orchestrator/train,
    model=tiny, one micro-batch, forward and backward, one process): the block's measured time
    over the kernels the shape model counts for it. Module calls, autograd and Python between
    the ops are what a tiny model's step costs on a CPU, far above a bare op's dispatch."""
    import torch

    from orchestrator.plan.kernels import layer_features, shape_of
    from orchestrator.plan.model import ModelMath
    from orchestrator.plan.plan import plan_spec
    from orchestrator.train.model import Block

    torch.set_num_threads(1)  # as the runtime's ranks run (OMP_NUM_THREADS=1)
    spec = tiny_spec("cluster.nodes=1", "hardware.gpus_per_node=1", "hardware.kernel_model=shape")
    plan = plan_spec(spec)
    tr = spec.training
    count = layer_features(ModelMath(spec.model), False, shape_of(plan.layout, tr, spec.hardware, spec)).kernels * 1e6
    block = Block(spec.model, 0)
    x = torch.randn(tr.micro_batch, tr.seq_len, spec.model.hidden, requires_grad=True)
    return _best(lambda: block(x).sum().backward(), repeat=9, number=5) / count * 1e6


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=CALL_TIMEOUT_S))
    from torch.distributed.device_mesh import init_device_mesh

    # latency and bandwidth between the ranks of each pair, every pair at once (as the calls below)
    pair = init_device_mesh("cpu", (world // PAIR, PAIR), mesh_dim_names=("pairs", "pair"))["pair"].get_group()
    small, big = torch.zeros(2), torch.zeros(1 << 20)
    for _ in range(10):
        dist.all_reduce(small, group=pair)
    dist.barrier()
    lat = _best(lambda: dist.all_reduce(small, group=pair), repeat=5, number=40)
    bw_t = _best(lambda: dist.all_reduce(big, group=pair), repeat=3, number=3)
    calls = runtime_calls(world)
    models = model_calls(world, rank) + pipeline_calls(world)
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(str(x) for x in (lat, bw_t, big.numel() * 4, *calls, *models)))
    _leave(dist)


def runtime_calls(world: int) -> tuple[float, float, float]:
    """Seconds per call of the collectives as the runtime issues them, at the tiny model's
    sizes (hidden 64, ffn 128, one 64-token micro-batch, fp32), each including its Python and
    dispatch around the wire, and each issued between pieces of work as the runtime issues them:
    ranks that computed arrive apart and gloo's threads wake, which costs several times a
    back-to-back call's latency on a loaded host: (DTensor redistribute, the mean of a sequence-parallel all-gather
    Shard(1) -> Replicate and reduce-scatter Partial -> Shard(1), as TP's layers run them;
    one DTensor op's host time above the plain op's (a small matmul, printed beside the model's);
    a plain c10d all-gather and all-reduce of a K/V-sized block (the loss parallel's calls, CP's where
    its own is not measured))."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    # over pairs of ranks, every pair at once (as the model is measured): the probe's `ranks` processes
    # share the cores as a run's do, and each call spans the group the cost model prices it for
    mesh = init_device_mesh("cpu", (world // PAIR, PAIR), mesh_dim_names=("pairs", "pair"))["pair"]
    group = mesh.get_group()
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

    part = DTensor.from_local(torch.randn(1, seq // PAIR, h), mesh, [Shard(1)], run_check=False)
    partial = DTensor.from_local(torch.randn(1, seq, h), mesh, [Partial()], run_check=False)
    ag = call(lambda: part.redistribute(mesh, [Replicate()]).to_local().sum())
    rs = call(lambda: partial.redistribute(mesh, [Shard(1)]).to_local().sum())
    a, w = torch.randn(seq, h), torch.randn(h, h)
    da = DTensor.from_local(a, mesh, [Replicate()], run_check=False)
    dw = DTensor.from_local(w, mesh, [Shard(1)], run_check=False)
    op = _best(lambda: torch.mm(da, dw), repeat=5, number=50) - _best(lambda: torch.mm(a, w), repeat=5, number=50)
    kv = torch.randn(1, seq // PAIR, h)
    outs = [torch.empty_like(kv) for _ in range(PAIR)]
    c10d = (call(lambda: dist.all_gather(outs, kv, group=group))
            + call(lambda: dist.all_reduce(kv, group=group))) / 2
    return max((ag + rs) / 2, 0.0), max(op, 0.0), max(c10d, 0.0)


def _timed_step(model, x, y, ctx=None) -> float:
    """Seconds of one micro-batch of `model` as the trainer runs it (forward, loss_fn, backward,
    the loss read), under `ctx` (a context manager factory: loss_parallel), after a warm-up."""
    import contextlib

    from orchestrator.train.trainer import _scalar, loss_fn

    def step():
        with (ctx or contextlib.nullcontext)():
            loss = loss_fn(model(x), y)
            loss.backward()
            _scalar(loss)
    step()
    return _best(step, repeat=5, number=3)


def model_calls(world: int, rank: int) -> tuple[float, ...]:
    """Seconds of one micro-batch of the runtime's own model (model=tiny, orchestrator/train), in
    every rank at once, as the trainer runs it (forward, loss_fn, backward, the loss read):
    plain on the whole sequence, plain on a CP rank's share of it, under TP and under CP over
    pairs of ranks (the runtime's apply_tp with loss_parallel, apply_cp with its token shard),
    sharded by FSDP2 over the pair (apply_fsdp: each block and the root, resharded after
    forward) with gradient sync off and on; and of one AdamW step over the plain model's and the
    TP model's parameters (DTensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from orchestrator.train.model import Transformer, cp_shard
    from orchestrator.train.parallel import apply_cp, apply_tp

    spec = tiny_spec()
    cfg = spec.model
    mesh = init_device_mesh("cpu", (world // PAIR, PAIR), mesh_dim_names=("pairs", "pair"))["pair"]
    pair, pair_rank = mesh.get_group(), mesh.get_local_rank()
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (1, spec.training.seq_len + 1))
    inp, lab = tokens[:, :-1], tokens[:, 1:]
    cp_inp, cp_lab = cp_shard(inp, PAIR, pair_rank), cp_shard(lab, PAIR, pair_rank)

    timed = _timed_step
    def adam(model) -> float:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        return _best(opt.step, repeat=5, number=3)

    plain = Transformer(cfg)
    whole, short = timed(plain, inp, lab), timed(plain, cp_inp, cp_lab)
    opt_plain = adam(plain)
    tp = Transformer(cfg)
    apply_tp(tp, mesh, loss_parallel=True)
    tp_mb = timed(tp, inp, lab, loss_parallel)
    opt_tp = adam(tp)
    cp = Transformer(cfg)
    apply_cp(cp, pair, PAIR, pair_rank)
    cp_mb = timed(cp, cp_inp, cp_lab)
    gathers, synced = _fsdp_times(cfg, mesh, inp, lab, timed)
    return whole, short, tp_mb, cp_mb, gathers, synced, opt_plain, opt_tp


def _fsdp_times(cfg, mesh, inp, lab, timed) -> tuple[float, float]:
    """One micro-batch of the runtime's model sharded by FSDP2 over `mesh` (apply_fsdp: each block
    and the root, resharded after forward), gradient sync off (as the trainer accumulates: the
    gathers only), then on (the last micro-batch: and the reduce-scatter)."""
    from orchestrator.train.model import Transformer
    from orchestrator.train.parallel import apply_fsdp

    fsdp = Transformer(cfg)
    apply_fsdp(fsdp, mesh, reshard_after_forward=True, mp=None)
    fsdp.set_requires_gradient_sync(False)
    gathers = timed(fsdp, inp, lab)
    fsdp.set_requires_gradient_sync(True)
    synced = timed(fsdp, inp, lab)
    return gathers, synced




def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 over all `world` processes (a group wider than a pair): the plain model and the
    sharded one, timed in every rank at once, as model_calls times them over a pair."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from orchestrator.train.model import Transformer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=CALL_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    spec = tiny_spec()
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.model.vocab, (1, spec.training.seq_len + 1))
    inp, lab = tokens[:, :-1], tokens[:, 1:]

    plain = _timed_step(Transformer(spec.model), inp, lab)
    gathers, synced = _fsdp_times(spec.model, mesh, inp, lab, _timed_step)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{plain} {gathers} {synced}")
    _leave(dist)


def _leave(dist) -> None:
    """A probe process that wrote its figures leaves without the interpreter's teardown, which can
    abort a finished gloo rank ('terminate called without an active exception'), as the runtime's
    ranks leave (orchestrator/rundir exit_now)."""
    from orchestrator.rundir import exit_now

    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def fsdp_group(world: int = FSDP_GROUP) -> dict:
    """FSDP2 over `world` processes at once (milliseconds), and the cores' worth they get (`work_s`:
    the same slice of work in `world` processes at once, to put the figures per uncontended core)."""
    plain, gathers, synced = _spawned(_fsdp_worker, world)
    return {"group": world, "plain_ms": plain * 1e3, "gathers_ms": gathers * 1e3, "synced_ms": synced * 1e3,
            "work_s": _slowest(world)}


PIPE_MICROBATCHES = 8


def pipeline_calls(world: int) -> tuple[float, float]:
    """Seconds of a pipelined step and of one micro-batch of the slowest stage alone: pairs of
    ranks hold the two halves of the runtime's model (Transformer.keep_only, as parallel.py cuts
    stages) as torch's PipelineStage under Schedule1F1B (the runtime's pipeline module) over
    PIPE_MICROBATCHES micro-batches; alone, each half runs a micro-batch's forward and backward
    (the last with the loss) with no schedule around it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from orchestrator.train.model import Transformer
    from orchestrator.train.trainer import loss_fn

    spec = tiny_spec()
    cfg, seq = spec.model, spec.training.seq_len
    mesh = init_device_mesh("cpu", (world // PAIR, PAIR), mesh_dim_names=("pairs", "pair"))["pair"]
    me, half = mesh.get_local_rank(), cfg.layers // 2
    torch.manual_seed(0)
    part = Transformer(cfg).keep_only(me * half, (me + 1) * half if me == 0 else cfg.layers, me == 0, me == 1)
    m = PIPE_MICROBATCHES
    tokens = torch.randint(0, cfg.vocab, (m, seq + 1))
    hidden = torch.randn(1, seq, cfg.hidden, requires_grad=True)

    def alone():
        if me == 0:
            part(tokens[:1, :-1]).sum().backward()
        else:
            loss_fn(part(hidden), tokens[:1, 1:]).backward()

    alone()
    stage_s = torch.tensor([_best(alone, repeat=5, number=5)])
    dist.all_reduce(stage_s, op=dist.ReduceOp.MAX, group=mesh.get_group())
    stage = PipelineStage(part, me, PAIR, torch.device("cpu"), group=mesh.get_group())
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)

    def step():
        if me == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:])

    step()
    return _best(step, repeat=5, number=1), float(stage_s)


# Each derived term and the raw figures it comes from (probe()'s gloo figures and the runtime's
# model times, MODEL_TIMES): derive() records them beside the terms, so a preset's term can be
# traced to what was timed.
DERIVED_FROM = {
    "dtensor_op_us": ("model_ms.tp", "model_ms.plain", "tp_call_us", "c10d_call_us"),
    "cp_call_us": ("model_ms.cp", "model_ms.plain_cp_tokens"),
    "fsdp_gather_us": ("model_ms.fsdp_gathers", "model_ms.plain"),
    "fsdp_reduce_us": ("model_ms.fsdp_synced", "model_ms.fsdp_gathers"),
    "optimizer_us": ("model_ms.adam",),
    "dtensor_optimizer_us": ("model_ms.adam_tp", "model_ms.adam"),
    "pp_microbatch_us": ("model_ms.pipelined_step", "model_ms.slowest_stage", "latency_us", "bus_gbps"),
    "fsdp_gather_step_us": ("fsdp_group.gathers_ms", "fsdp_group.plain_ms", "fsdp_group.work_s",
                            "model_ms.fsdp_gathers", "model_ms.plain"),
    "fsdp_reduce_step_us": ("fsdp_group.synced_ms", "fsdp_group.gathers_ms", "fsdp_group.work_s",
                            "model_ms.fsdp_synced", "model_ms.fsdp_gathers"),
}


@lru_cache(maxsize=1)
def _tiny_counts() -> tuple[float, int, int, int]:
    """What the cost model counts for the tiny model under TP over a pair (one stage): kernels per
    micro-batch (plan/kernels.py), layers, redistributes (plan/overheads.py) and parameter tensors."""
    from orchestrator.plan.kernels import shape_of, stage_features
    from orchestrator.plan.overheads import parameter_tensors
    from orchestrator.plan.plan import shape_plan

    spec = tiny_spec("cluster.nodes=1", f"hardware.gpus_per_node={PAIR}", f"layout.tp={PAIR}",
                     "hardware.kernel_model=shape")
    shaped = shape_plan(spec)
    st = shaped.stages[0]
    kernels = stage_features(st, shaped.mm, shape_of(shaped.layout, spec.training, spec.hardware, spec)).kernels * 1e6
    n = len(st.layers)
    return kernels, n, 8 * n + 2 * (st.embeds + st.outputs), parameter_tensors(st, shaped.mm)


@lru_cache(maxsize=1)
def _tiny_send_bytes() -> float:
    """Bytes of one pipeline send of the tiny model over two stages, as the cost model counts them."""
    from orchestrator.plan.plan import shape_plan

    shaped = shape_plan(tiny_spec("cluster.nodes=1", f"hardware.gpus_per_node={PAIR}", f"layout.pp={PAIR}"))
    pp = shaped.axes["pp"]
    return pp.bytes_per_microbatch / (2 * shaped.layout.chunks)


def _derived(tp_call: float, c10d: float, send: float, whole: float, short: float, tp_mb: float, cp_mb: float,
             gathers: float, synced: float, opt_plain: float, opt_tp: float, pipe: float, stage: float
             ) -> tuple[dict, list]:
    """The per-op and per-call costs the model's measurements leave once the calls the cost model
    counts for it (plan/overheads.py, plan/kernels.py) are taken out (arguments in seconds, the
    results in microseconds, as the preset holds them), and the terms whose measured difference
    came out below zero (noise larger than the cost: zero in the preset, and named)."""
    kernels, n, redistributes, params = _tiny_counts()
    loss = 4  # as overheads.host_calls counts them
    # (difference, per what): each cost is the model's time less what is counted, per op, call,
    # unit, tensor or micro-batch
    raw = {
        "dtensor_op_us": (tp_mb - whole - redistributes * tp_call - loss * c10d, kernels),
        "cp_call_us": (cp_mb - short, 4 * n),
        # FSDP2's units: every block and the root (overheads.host_calls)
        "fsdp_gather_us": (gathers - whole, n + 1), "fsdp_reduce_us": (synced - gathers, n + 1),
        "optimizer_us": (opt_plain, params), "dtensor_optimizer_us": (opt_tp - opt_plain, params),
        # 1F1B over two stages: M micro-batches and one of bubble at the slowest stage's pace, and
        # the two sends on the critical path of fill and drain at the wire's latency and bytes
        # (plan/cost.py p2p: 2 (pp x chunks - 1) sends); the rest is the schedule's and
        # PipelineStage's own host time per micro-batch, its batched sends and receives included
        "pp_microbatch_us": (pipe - (PIPE_MICROBATCHES + 1) * stage - 2 * send, PIPE_MICROBATCHES)}
    floored = sorted(k for k, (d, _) in raw.items() if d < 0)
    return {k: max(d, 0.0) / per * 1e6 for k, (d, per) in raw.items()}, floored


def _spawned(worker, ranks: int) -> list[float]:
    """Run `worker(rank, ranks, port, out)` in `ranks` gloo processes (one thread each, as the
    runtime's ranks run); the figures rank 0 wrote to `out`."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.txt")
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(worker, args=(ranks, port, out), nprocs=ranks, join=True)
        return [float(x) for x in open(out).read().split()]


def collectives(ranks: int = 2) -> dict:
    lat, bw_t, nbytes, tp, op, c10d, *models = _spawned(_worker, ranks)
    bus = 2.0 * (PAIR - 1) / PAIR * nbytes / bw_t / 1e9  # an all-reduce within a pair
    return {"ranks": ranks, "group": PAIR, "latency_us": lat * 1e6, "bus_gbps": bus, "tp_call_us": tp * 1e6,
            "bare_dtensor_op_us": op * 1e6, "c10d_call_us": c10d * 1e6,
            "model_ms": dict(zip(MODEL_TIMES, (x * 1e3 for x in models)))}


MODEL_TIMES = ("plain", "plain_cp_tokens", "tp", "cp", "fsdp_gathers", "fsdp_synced", "adam", "adam_tp",
               "pipelined_step", "slowest_stage")  # model_calls, then pipeline_calls


def derive(measured: dict) -> dict:
    """What the raw figures of a probe (or the quietest of several) give: the per-op and per-call
    costs of the runtime's model beyond the calls counted (_derived), and the cores' worth; with
    `terms` (each preset key the probe fills -> the raw figures it comes from) and `floored` (the
    derived terms whose measured difference was below zero, set to zero)."""
    out = dict(measured)
    g = dict(measured["gloo"])
    send = g["latency_us"] * 1e-6 + _tiny_send_bytes() / (g["bus_gbps"] * 1e9)  # one pipeline send of the pair
    model, floored = _derived(g["tp_call_us"] * 1e-6, g["c10d_call_us"] * 1e-6, send,
                              *(g["model_ms"][k] * 1e-3 for k in MODEL_TIMES))
    g.update(model)
    out["gloo"] = g
    # Where each of the preset's measured terms comes from (the raw figures timed for it), and
    # which came out below zero and stand at zero: the preset's record of what it measured.
    out["terms"] = {**MEASURED_FROM, **{k: tuple("gloo." + f for f in v) for k, v in DERIVED_FROM.items()}}
    out["floored"] = floored
    ranks = measured.get("ranks", g["ranks"])
    out["host_cores"] = cores_worth(ranks, measured["work_s"], measured["work_together_s"], measured["cores_allowed"])
    # the pair's own share, to take out of the figures timed in it (site_preset)
    out["pair_cores"] = cores_worth(g["ranks"], measured["work_s"], measured.get("work_pair_s",
                                    measured["work_together_s"]), measured["cores_allowed"])
    wide = g.get("fsdp_group")
    if wide:  # FSDP2 over a wider group: what each rank more in the group adds per unit and call
        steps, low = _fsdp_steps(g, wide, measured, out["pair_cores"])
        g.update(steps)
        out["floored"] = sorted(set(out["floored"]) | set(low))
    else:  # not measured: the keys stay out of the preset, and a wider group out of the predictions
        out["terms"] = {k: v for k, v in out["terms"].items() if k not in FSDP_STEP_KEYS}
    return out


FSDP_STEP_KEYS = ("fsdp_gather_step_us", "fsdp_reduce_step_us")


def _fsdp_steps(g: dict, wide: dict, measured: dict, pair_cores: float) -> tuple[dict, list]:
    """Per FSDP2 unit and call, what each rank beyond a pair adds (microseconds, in the pair's
    terms, as site_preset holds the calls): the wider group's gathers (and reduce-scatter) above
    its plain model, per uncontended core (its processes share the cores: cores_worth), less the
    pair's, over the ranks it adds (a ring's steps grow with the group: n - 1)."""
    units = _tiny_counts()[1] + 1  # every block and the root (overheads.host_calls)
    n = wide["group"]
    wide_share = max(1.0, n / max(cores_worth(n, measured["work_s"], wide["work_s"], measured["cores_allowed"]),
                                  1e-9))
    pair_share = max(1.0, g["ranks"] / pair_cores) if pair_cores else 1.0
    ms = g["model_ms"]
    raw = {"fsdp_gather_step_us": ((wide["gathers_ms"] - wide["plain_ms"]) / wide_share,
                                   (ms["fsdp_gathers"] - ms["plain"]) / pair_share),
           "fsdp_reduce_step_us": ((wide["synced_ms"] - wide["gathers_ms"]) / wide_share,
                                   (ms["fsdp_synced"] - ms["fsdp_gathers"]) / pair_share)}
    steps = {k: (w - p) * pair_share / units / (n - PAIR) * 1e3 for k, (w, p) in raw.items()}
    return {k: max(v, 0.0) for k, v in steps.items()}, sorted(k for k, v in steps.items() if v < 0)


def cores_worth(ranks: int, alone_s: float, together_s: float, allowed: int) -> float:
    """The cores the ranks really get: the same work in `ranks` processes at once (`together_s`, the
    slowest) against one alone (other load on the host takes its share; ranks beyond these share
    their time); at least one (the single-process figures already carry the load one process sees)."""
    got = ranks * alone_s / together_s
    return round(min(float(allowed), max(got, 1.0)), 2) if got < ranks * 0.95 else float(allowed)


def _work_together(barrier, queue) -> None:
    import torch

    torch.set_num_threads(1)  # as the runtime's ranks run (OMP_NUM_THREADS=1)
    _work()
    barrier.wait()
    t = time.perf_counter()
    for _ in range(5):
        _work()
    queue.put((time.perf_counter() - t) / 5)


def _slowest(n: int) -> float:
    """Seconds per _work of the slowest of `n` processes doing it at once (forked, one thread each,
    as the runtime's ranks run): the probe's and cores_now()'s one measurement of the cores' worth."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_work_together, args=(barrier, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    out = max(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return out


def cores_now(ranks: int) -> float:
    """The cores' worth `ranks` processes get on this host now, as the probe's `host_cores` is
    measured (cores_worth: _work in `ranks` processes at once against one alone, each timed the
    same way, one after the other), in a second or two: beside a run, what other load on a
    shared host leaves it (benchmarks/readme_cpu.py)."""
    alone, together = _slowest(1), _slowest(ranks)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores_worth(ranks, alone, together, allowed)


def probe(ranks: int = 2) -> dict:
    """One probe's raw figures (derive() turns them into the preset's): every call, latency and the
    runtime's model over one pair of processes (collectives(PAIR): no more processes than it needs,
    so each term is what it costs, not what sharing the cores adds), and the cores' worth the
    `ranks` processes of a run get at once (how they share the host: measured, not assumed)."""
    out = local_components()
    out["ranks"] = ranks
    out["gloo"] = collectives(PAIR)
    if ranks >= FSDP_GROUP:  # FSDP2 over a wider group, as a run of that many processes shards
        out["gloo"]["fsdp_group"] = fsdp_group(FSDP_GROUP)
    # Twice more, seconds apart, the least disturbed kept: on a shared host the other load changes
    # from second to second, and a run's fastest steps see its quiet moments.
    for _ in range(2):
        out["layer_op_us"] = min(out["layer_op_us"], layer_op_us())
        out["work_s"] = min(out["work_s"], _slowest(1))
        out["work_together_s"] = min(out.get("work_together_s", float("inf")), _slowest(ranks))
        out["work_pair_s"] = min(out.get("work_pair_s", float("inf")), _slowest(PAIR))
        if "fsdp_group" in out["gloo"]:
            out["gloo"]["fsdp_group"]["work_s"] = min(out["gloo"]["fsdp_group"]["work_s"], _slowest(FSDP_GROUP))
        time.sleep(1.0)
    out["cores_allowed"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return out


RATES = ("gemm_tflops", "hbm_gbps", "bus_gbps", "cores_allowed", "ranks", "group")  # higher: quieter


def quietest(results: list[dict]) -> dict:
    """Each raw figure of several probes at its least disturbed: the highest rate, the lowest time
    (derive() then works from these, not from each probe's differences). On a shared host other
    load comes and goes over seconds; a run's fastest steps see its quiet moments, and so should
    the figures that predict them."""
    first = results[0]
    out = {}
    for key, value in first.items():
        values = [r[key] for r in results]
        if isinstance(value, dict):
            out[key] = quietest(values) if key != "gemm_tflops" else {n: max(v[n] for v in values) for n in value}
        else:
            out[key] = max(values) if key in RATES else min(values)
    return out


def site_preset(measured: dict, base: dict) -> dict:
    """The `cpu` preset (`base`) with the measured components in place of its rough figures.
    Every key the probe fills comes from the measured figures (KeyError naming the figure when
    one is missing), never from a default."""
    g = measured["gloo"]
    # The calls were timed with the pair sharing the cores it got; the preset holds them per
    # uncontended core (the cost model scales them by each layout's own core share, host_cores).
    pair = measured.get("pair_cores", measured["host_cores"])
    shared = max(1.0, g["ranks"] / pair) if pair else 1.0
    hw = dict(base)
    hw.update(name="site", peak_tflops=round(max(measured["gemm_tflops"].values()), 6), gemm_efficiency=1.0,
              hbm_gbps=round(measured["hbm_gbps"], 3), intra_node_gbps=round(g["bus_gbps"], 3),
              inter_node_gbps=round(g["bus_gbps"], 3), intra_node_latency_us=round(g["latency_us"], 2),
              inter_node_latency_us=round(g["latency_us"], 2), kernel_model="shape",
              launch_overhead_us=round(measured["layer_op_us"], 3),
              host_cores=float(measured["host_cores"]),
              **{k: round(g[k] / shared, 2) for k in CALL_KEYS if k in g or k not in FSDP_STEP_KEYS})
    for k in FSDP_STEP_KEYS:  # FSDP2 over a wider group, unless timed: not in the preset (a default is no figure)
        if k not in g:
            hw.pop(k, None)
    return hw

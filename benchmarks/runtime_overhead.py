"""Runtime overhead on this machine, same run:

1. step time of the orchestrator's runtime (one process, launcher=local) against a
   plain hand-written single-process loop of the same tiny model, data and optimizer;
2. time from command to the first finished step: `orchestrate ... launcher=local`
   against `torchrun` starting the same training function (2 processes, DP2);
3. the same for the demo's 8 ranks (TP2 x PP2 x DP2 on 2 x 4), ranks forked from the
   fork server (the default) against one interpreter per rank (ORCH_FORK_SERVER=0),
   with the CPU seconds the whole run took.

Run: .venv/bin/python benchmarks/runtime_overhead.py
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COMMON = ["hardware=cpu", "model=tiny", "training.steps=30", "figures=false"]


def plain_loop(steps: int = 30) -> list[float]:
    import torch
    import torch.nn.functional as F

    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.train.data import TokenSource
    from orchestrator.train.model import Transformer

    torch.set_num_threads(1)
    cfg = typed(compose(COMMON))
    m = cfg.model
    torch.manual_seed(0)
    model = Transformer(m)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = TokenSource(m.vocab, cfg.training.seq_len, 0)
    B = cfg.training.global_batch
    times = []
    for step in range(steps):
        tokens = data.batch(list(range(step * B, (step + 1) * B)))
        t0 = time.perf_counter()
        for k in range(B):
            x, y = tokens[k:k + 1, :-1], tokens[k:k + 1, 1:]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / B
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def first_step_seconds(cmd: list[str], env=None) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **(env or {})))
    first = None
    for line in p.stdout:
        if first is None and "step 1/" in line:
            first = time.perf_counter() - t0
    p.wait()
    if p.returncode or first is None:
        raise SystemExit(f"{cmd} failed ({p.returncode})")
    return first


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "single"
        subprocess.run([sys.executable, "-m", "orchestrator", *COMMON, "cluster.nodes=1", "hardware.gpus_per_node=1",
                        "launcher=local", f"hydra.run.dir={run}"], cwd=ROOT, check=True, capture_output=True)
        ours = json.loads((run / "metrics.json").read_text())["step_time_s"][2:]
        plain = plain_loop()[2:]
        a, b = statistics.median(ours), statistics.median(plain)
        print(f"step time, tiny model, 1 process: runtime {a * 1e3:.1f} ms, plain loop {b * 1e3:.1f} ms, "
              f"ratio {a / b:.2f}")

        dp2 = [*COMMON, "training.steps=3", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2"]
        ours_first = first_step_seconds([sys.executable, "-m", "orchestrator", *dp2, "launcher=local",
                                         f"hydra.run.dir={tmp}/dp2"])
        # torchrun starts the same worker on the plan the orchestrator wrote
        tr_dir = Path(tmp) / "torchrun"
        subprocess.run([sys.executable, "-m", "orchestrator", *dp2, "launcher=dry", f"hydra.run.dir={tr_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        from orchestrator.launch.processes import free_port

        tr_first = first_step_seconds([torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", "-m",
                                       "orchestrator.train.worker", str(tr_dir)],
                                      env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        print(f"command to first step, DP2 on 2 processes: orchestrate {ours_first:.2f} s "
              f"(compose + plan + launch), torchrun {tr_first:.2f} s")

        demo = [*COMMON, "training.steps=3", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2",
                "layout.pp=2", "layout.dp=2", "schedule=1f1b", "launcher=local"]
        for server in ("1", "0"):
            before = os.times()
            first = first_step_seconds([sys.executable, "-m", "orchestrator", *demo,
                                        f"hydra.run.dir={tmp}/demo{server}"], env={"ORCH_FORK_SERVER": server})
            after = os.times()
            cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
            print(f"command to first step, TP2 x PP2 x DP2 on 8 processes, "
                  f"{'fork server' if server == '1' else 'one interpreter per rank'}: {first:.2f} s "
                  f"({cpu:.1f} s of CPU for the 3-step run)")


if __name__ == "__main__":
    main()

"""Lose a node, lose nothing: the launcher (not the ranks) owns failure.

When a rank or an emulated node dies, the launcher marks that node lost,
re-plans on the survivors (TP, CP, PP stay; DP shrinks to what fits; nodes that
no longer fit a whole replica become idle spares), keeps the global batch by
giving each replica more micro-batches (or says exactly what changed, per
`failover.batch_policy`), restarts the job and lets it resume from the latest
complete checkpoint, resharded into the new layout. Each failover is logged on
the console, in TensorBoard and in RUN_DIR/failover.json.

`replan_on_survivors` is torch-free and shared with the SLURM launcher.
"""
from __future__ import annotations

import copy
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from orchestrator.plan import make_plan
from orchestrator.plan.errors import Problem


@dataclass
class Replan:
    cfg: object | None
    plan: object | None
    nodes: int
    spares_gpus: int
    changes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def replan_on_survivors(cfg, alive_nodes: int) -> Replan:
    """The best layout on `alive_nodes` nodes keeping TP, CP, PP (and EP)."""
    lay, tr, gpn = cfg.layout, cfg.training, cfg.hardware.gpus_per_node
    old_dp = make_plan(cfg).degrees.dp if not isinstance(lay.dp, int) else lay.dp
    replica = lay.tp * lay.cp * lay.pp
    B, b = tr.global_batch, tr.micro_batch
    tried = []
    for n in range(alive_nodes, 0, -1):
        world = n * gpn
        if world % replica:
            tried.append(f"{n} nodes: {world} GPUs do not hold whole replicas of {replica}")
            continue
        dp = world // replica
        if dp < cfg.failover.min_dp:
            tried.append(f"{n} nodes: dp {dp} < failover.min_dp {cfg.failover.min_dp}")
            break
        if dp % lay.ep:
            tried.append(f"{n} nodes: dp {dp} is not a multiple of ep {lay.ep}")
            continue
        changes = [f"dp {old_dp} -> {dp}"]
        new_b, new_B = b, B
        if B % (dp * b):
            fits = [x for x in range(b - 1, 0, -1) if B % (dp * x) == 0]
            if fits:
                new_b = fits[0]
                changes.append(f"micro_batch {b} -> {new_b} to keep global_batch {B}")
            elif cfg.failover.batch_policy == "adjust":
                new_B = (B // (dp * b)) * dp * b
                if new_B == 0:
                    tried.append(f"{n} nodes: dp {dp} x micro_batch {b} exceeds global_batch {B}")
                    continue
                changes.append(f"global_batch {B} -> {new_B} (failover.batch_policy=adjust)")
            else:
                tried.append(f"{n} nodes: global_batch {B} does not split over dp {dp} (batch_policy=keep)")
                continue
        new = copy.deepcopy(cfg)
        with open_dict(new):
            new.cluster.nodes = n
            new.layout.dp = dp
            new.training.micro_batch = new_b
            new.training.global_batch = new_B
            new.layout.search = False
        plan = make_plan(new)
        if not plan.valid:
            tried.append(f"{n} nodes: " + "; ".join(str(e) for e in plan.errors))
            continue
        m_old = B // (old_dp * b)
        changes.append(f"micro-batches per replica {m_old} -> {plan.degrees.microbatches}")
        return Replan(new, plan, n, (alive_nodes - n) * gpn, changes, tried)
    return Replan(None, None, 0, alive_nodes * gpn, [], tried)


def _fault_step(cfg) -> int | None:
    f = cfg.fault
    if f.kill_node is None:
        return None
    if f.mode == "random":
        return random.Random(f.seed).randint(1, max(cfg.training.steps - 1, 1))
    return f.at_step


def steps_completed(run_dir: Path, attempts) -> int:
    """Steps the given attempts completed (from rank 0's metrics.jsonl); 0 if none."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    done = 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        if rec.get("attempt") in attempts:
            done = max(done, rec["step"] + 1)
    return done


def config_problems(cfg) -> list[Problem]:
    """fault.* and failover.* settings, checked before anything starts."""
    f, fo, out = cfg.fault, cfg.failover, []
    if f.mode not in ("step", "random", "during_save"):
        out.append(Problem("fault.mode", f"unknown mode {f.mode!r}.", "use step, random or during_save."))
    if f.kill_node is not None:
        if not 0 <= f.kill_node < cfg.cluster.nodes:
            out.append(Problem("fault.kill_node", f"node {f.kill_node} does not exist: cluster.nodes is "
                               f"{cfg.cluster.nodes}.", f"use 0 .. {cfg.cluster.nodes - 1}."))
        if f.mode != "random" and f.at_step is None:
            out.append(Problem("fault.at_step", f"fault.kill_node={f.kill_node} needs the step to kill it at.",
                               "set fault.at_step=<step>, or fault.mode=random."))
        if f.mode == "during_save" and cfg.training.checkpoint.every <= 0:
            out.append(Problem("fault.mode, training.checkpoint.every", "during_save needs checkpoints, but "
                               "training.checkpoint.every is 0.", "set training.checkpoint.every=<steps>."))
    if fo.batch_policy not in ("keep", "adjust"):
        out.append(Problem("failover.batch_policy", f"unknown policy {fo.batch_policy!r}.", "use keep or adjust."))
    if fo.max_failovers < 0 or fo.min_dp < 1:
        out.append(Problem("failover.max_failovers, failover.min_dp", f"need max_failovers >= 0 and min_dp >= 1, "
                           f"got {fo.max_failovers} and {fo.min_dp}.", "use e.g. 3 and 1."))
    return out


def layout_of(plan, nodes: int) -> dict:
    d = plan.degrees
    return {"nodes": nodes, "tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "microbatches": d.microbatches}


def record_failover(out_dir: Path, events: list[dict], *, attempt: int, node, old_plan, old_nodes: int,
                    rp: Replan, url: str, **extra) -> dict:
    """Append one failover to failover.json and TensorBoard (the local and SLURM launchers share it)."""
    from orchestrator.train import checkpoint as ckpt

    done = steps_completed(out_dir, range(attempt + 1))
    resume_from = ckpt.latest_complete(url) or 0
    event = {"attempt": attempt, "time": time.time(), "node": node,
             "old_layout": layout_of(old_plan, old_nodes), "new_layout": layout_of(rp.plan, rp.nodes),
             "spare_gpus": rp.spares_gpus, "changes": rp.changes, "failed_after_step": done,
             "resumed_from_step": resume_from, "steps_lost": max(done - resume_from, 0), **extra}
    events.append(event)
    _write_events(out_dir, events)
    _tensorboard_event(out_dir, event, len(events))
    return event


def preflight(cfg, out_dir: Path) -> list[Problem]:
    """Refuse to launch a run with bad fault/failover settings or one that cannot resume from its
    checkpoint directory (torch-free)."""
    from orchestrator.train import checkpoint as ckpt

    problems = config_problems(cfg)
    if problems:
        return problems
    url = ckpt.url_for(cfg.training.checkpoint.dir, out_dir)
    latest = ckpt.latest_complete(url)
    if latest is None:
        return []
    meta = ckpt.read_meta(url, latest)
    model = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    training = OmegaConf.to_container(cfg.training, resolve=True, enum_to_str=True)
    return [Problem(k, m + ".", "point training.checkpoint.dir at a new location, or restore the setting" +
                    (", or set training.resume.allow_batch_change=true" if k.startswith("training.") else "") + ".")
            for k, m in ckpt.compatibility_problems(meta, model, training)]


def run_with_failover(cfg, plan, out_dir: Path, echo: bool = True) -> int:
    from orchestrator.cli import write_plan
    from orchestrator.launch.local import LocalJob
    from orchestrator.train.checkpoint import url_for

    problems = preflight(cfg, out_dir)
    if problems:
        print("\nREJECTED: nothing was launched.", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    gpn = cfg.hardware.gpus_per_node
    alive = list(range(cfg.cluster.nodes))  # physical (emulated) node ids still in service
    fault_step = _fault_step(cfg)
    url = url_for(cfg.training.checkpoint.dir, out_dir)
    events: list[dict] = []
    attempt, cur_cfg, cur_plan = 0, cfg, plan
    while True:
        plan_dir = out_dir if attempt == 0 else out_dir / f"attempt{attempt}"
        if attempt:
            write_plan(cur_plan, plan_dir, figures=False)
        env = {"ORCH_RUN_DIR": str(out_dir), "ORCH_ATTEMPT": str(attempt)}
        armed = attempt == 0 and fault_step is not None
        if armed and cfg.fault.mode == "during_save":
            env.update(ORCH_FAULT_MODE="during_save", ORCH_FAULT_NODE=str(cfg.fault.kill_node),
                       ORCH_FAULT_STEP=str(fault_step))
        job = LocalJob(plan_dir, nodes=len(alive), gpus_per_node=gpn, env=env, echo=echo)
        job.start()
        state = {"killed_at": None, "killed_wall": None}

        def on_poll(j, attempt=attempt):
            if armed and cfg.fault.mode != "during_save" and state["killed_at"] is None:
                if steps_completed(out_dir, (attempt,)) >= fault_step:
                    print(f"fault injection: killing every process of node {cfg.fault.kill_node} "
                          f"after step {fault_step}", flush=True)
                    state["killed_at"], state["killed_wall"] = time.monotonic(), time.time()
                    j.kill_node(alive.index(cfg.fault.kill_node))

        t_start = time.monotonic()
        res = job.wait(on_poll=on_poll)
        if res.ok:
            if events:
                print(f"\nfinished after {len(events)} failover(s); see {out_dir / 'failover.json'}")
            return 0
        t_fail = time.monotonic()
        lost = alive[res.failed_node]
        print(f"\nFAILURE: {res.cause}; marking node {lost} lost", file=sys.stderr, flush=True)
        if not cfg.failover.enabled or len(events) >= cfg.failover.max_failovers:
            why = "failover is off" if not cfg.failover.enabled else f"failover.max_failovers={cfg.failover.max_failovers} reached"
            print(f"STOPPED: {why}; {len(events)} failover(s) so far.", file=sys.stderr)
            return 1
        t0 = time.monotonic()
        alive.remove(lost)
        rp = replan_on_survivors(cur_cfg, len(alive))
        replan_s = time.monotonic() - t0
        if rp.plan is None:
            print(f"STOPPED: no layout fits the {len(alive)} surviving node(s): " + "; ".join(rp.problems),
                  file=sys.stderr)
            _write_events(out_dir, events + [{"node": lost, "stopped": True, "reasons": rp.problems}])
            return 1
        used = alive[: rp.nodes]
        event = record_failover(
            out_dir, events, attempt=attempt, node=lost, old_plan=cur_plan, old_nodes=len(alive) + 1, rp=rp,
            url=url, cause=res.cause, nodes_in_service=used,
            seconds={"detection": (t_fail - state["killed_at"]) if state["killed_at"] else None,
                     "replan": replan_s, "run_before_failure": t_fail - t_start},
            killed_at=state["killed_wall"], relaunched_at=time.time())
        print(f"FAILOVER {len(events)}: node {lost} lost after step {event['failed_after_step']}; re-planned on "
              f"{rp.nodes} node(s): {', '.join(rp.changes)}; spares {rp.spares_gpus} GPU(s); resuming from step "
              f"{event['resumed_from_step']} ({event['steps_lost']} step(s) lost)", flush=True)
        alive = used
        cur_cfg, cur_plan = rp.cfg, rp.plan
        attempt += 1


def _write_events(out_dir: Path, events: list[dict]) -> None:
    (out_dir / "failover.json").write_text(json.dumps(events, indent=1) + "\n")


def _tensorboard_event(out_dir: Path, event: dict, n: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(out_dir / "tensorboard"))
    step = event["resumed_from_step"]
    w.add_scalar("failover/count", n, step)
    w.add_scalar("failover/dp", event["new_layout"]["dp"], step)
    w.add_scalar("failover/steps_lost", event["steps_lost"], step)
    w.add_text("failover", json.dumps(event, indent=1), step)
    w.close()

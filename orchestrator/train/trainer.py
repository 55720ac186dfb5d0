"""One rank of a training job, as the phases of a Trainer.

Reads PLAN_DIR/plan.json and derives nothing layout-shaped: the meshes come from its
rank grids, this rank's model chunks from its stage list, the data split from its data
axis. Outputs go to ORCH_RUN_DIR (default PLAN_DIR), shared by every attempt of a run:
rank 0 writes TensorBoard events, metrics.json (this attempt) and metrics.jsonl (every
step of every attempt); the first rank of each data-parallel replica records the sample
indices it read (samples/).
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from orchestrator import rundir
from orchestrator.rundir import EXIT_FAILED, EXIT_LEFT, EXIT_NO_CHECKPOINT, RankExit
from orchestrator.config.schema import RANK_KINDS, Device, FaultKind, FaultMode, Precision
from orchestrator.rundir import checkpoints as saves
from orchestrator.rundir import events
from orchestrator.rundir.metrics import measured_mfu
from orchestrator.rundir.plan import RunPlan
from orchestrator.train import checkpoint as ckpt
from orchestrator.train.data import TokenSource, share
from orchestrator.train.logger import Logger
from orchestrator.train import keeper, wire, world
from orchestrator.train.model import cp_shard
from orchestrator.train.moe import ExpertSteps
from orchestrator.plan.split import lost_microbatches, recompute_run, recompute_share
from orchestrator.train.parallel import build_model_parts, clip_grad_norm, keep_grads, sync_replicas
from orchestrator.train.profile import StepProfiler
from orchestrator.train.replicas import Replicas
from orchestrator.train.world import world_rank

log = logging.getLogger(__name__)

IGNORE = -100  # the label of a padding micro-batch's tokens: they add nothing to the loss or the gradient


def loss_fn(logits, labels):
    """Token-mean cross entropy of one micro-batch (a padding one: 0, and no gradient)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE) / labels.numel()


def _scalar(x) -> float:
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x.detach())


class Trainer:
    def __init__(self, plan_dir: Path, should_stop=None):
        self.plan_dir = Path(plan_dir)
        self.plan = RunPlan.load(self.plan_dir)
        self.spec = self.plan.config
        self.lay = self.plan.layout
        self.run_dir = Path(os.environ.get(rundir.ENV_RUN_DIR, self.plan_dir))
        self.attempt = int(os.environ.get(rundir.ENV_ATTEMPT, "0"))
        self.launched_attempt = self.attempt  # the attempt this process was started in (fault injection)
        self.fault_step = self.plan.fault_step
        self.should_stop = should_stop
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.joining = rundir.ENV_JOIN_COPY in os.environ  # a warm spare, or a node coming back
        if self.world != self.plan.world_size and not self.joining:
            raise RankExit(EXIT_FAILED, f"the job has WORLD_SIZE {self.world} but the plan needs {self.plan.world_size} "
                           f"(cluster.nodes x hardware.gpus_per_node); re-plan for this allocation")
        self.url = saves.url_for(self.spec.training.checkpoint.dir, self.run_dir)
        self.history: dict = {"loss": [], "step_time_s": []}
        self.max_norm = self.spec.clip_norm()  # 0: the step does not clip (nor compute the norm)
        self._grad_norm = None  # the last step's global gradient norm (a 0-d tensor), before the clip
        self._pending_snapshot = None  # a memory snapshot in flight (checkpoint.PendingSnapshot)
        self._kept = None  # a re-formed step's own gradients kept: {step, terms, dp_rank} (the answer said so)
        self._recover = None  # the recovery pass the new generation runs for the step in flight (reform)
        self._loss_scale = 1.0  # what the pipeline schedule's loss is multiplied by (its micro-batches' weight)
        self._snapshot_warned: set = set()

    # ---- phases ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Device, the torch world (the job's, or this copy's), meshes and coordinates."""
        hw = self.spec.hardware
        if hw.device == Device.cuda:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        job_store = world.env_store() if world.copies_of(self.plan) > 1 or self.joining else None
        if self.joining:
            self.place = world.spare_place(self.plan, int(os.environ[rundir.ENV_JOIN_COPY]), self.rank)
        else:
            self.place = world.place_of(self.plan, self.rank)
        self.meshes = world.init(self.plan, hw.backend.value, self.device.type, self.place, job_store)
        self.coords = self.place.coords
        self.replicas = None
        self._saving = self._saved = False  # a checkpoint save shares the copy's next step (its commit says so)
        if job_store is not None:
            first = [self.place.copy] if self.joining else list(range(self.lay["dp_replicate"]))
            self.replicas = Replicas(job_store, os.environ.get(rundir.ENV_CONTROL), self.place.copy, self.place.local,
                                     dist.get_world_size(), self.spec.failover.timeout_s, first)
            self.replicas.on_fenced = world.forget_beat  # a copy declared lost leaves: its last beat is no hang
            f = self.spec.fault  # fault.kind=cut_copy: fault.rank's copy cut off from the others (first attempt)
            if (f.kind == FaultKind.cut_copy and self.launched_attempt == 0 and self.fault_step is not None
                    and not self.joining and world.place_of(self.plan, f.rank).copy == self.place.copy):
                self.replicas.cut_from = self.fault_step

    def build(self) -> None:
        """Model chunks, one optimizer per chunk (torchtitan's way: each chunk's state dict then
        holds exactly its own parameters' names), and the pipeline schedule."""
        tr = self.spec.training
        mp = None
        if tr.precision == Precision.bf16 and self.device.type == "cuda":  # CPU runs fp32: bf16 is emulated there
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.parts = build_model_parts(self.plan, self.spec.model, self.meshes, self.coords, tr.seed, self.device,
                                       mp, recompute=tr.recompute.value, recompute_layers=tr.recompute_layers)
        # One fused pass on a GPU, as torchtitan's default (implementation="fused") and the plan's
        # ADAMW_BYTES: torch's default there is foreach, eight passes (plan/kernels.py)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opts = [torch.optim.AdamW(part.parameters(), lr=tr.lr, betas=(0.9, 0.95), eps=tr.adam_eps,
                                       weight_decay=0.0, **fused) for _, part in self.parts]
        ids = [i for i, _ in self.parts]
        self.has_first, self.has_last = 0 in ids, self.lay["num_stages"] - 1 in ids
        self.data = TokenSource(self.spec.model.vocab, tr.seq_len, tr.seed, tr.data)
        # The first rank of each data-parallel replica records what it read.
        self.records = self.coords["tp"] == 0 and self.coords["cp"] == 0 and self.has_first
        self.experts = ExpertSteps(self.parts, self.plan) if self.spec.model.moe.experts else None
        self.expert_stats = None
        self._layout_shaped()

    def _layout_shaped(self) -> None:
        """What follows from the current plan: schedule (its micro-batch count), data rank."""
        self.schedule = None
        if self.lay["pp"] > 1:
            from orchestrator.train.pipeline import build_schedule  # only with pipeline stages

            self.schedule, _, _ = build_schedule(self.plan, self.parts, self.meshes["dense"], self.device,
                                                 lambda out, y: loss_fn(out, y) * self._loss_scale)
        if self.replicas is None:
            self.dp_rank = self.coords[self.plan.mesh["data"]]
        else:
            self.dp_rank = self.replicas.index * self.lay["dp_shard"] + self.coords["dps"]
            self.rank = world_rank(self.plan, self.replicas.index, self.coords)
        self.leader = self.rank == 0  # writes metrics.jsonl and TensorBoard

    def resume(self) -> int:
        """Load the newest intact checkpoint (resharded into this layout); the step to start at.
        A damaged one (a file missing or altered, by its files.json) is reported and skipped. A
        restart the launcher pointed at a memory snapshot (keeper.RESTORE_JSON) loads that instead,
        when every rank fetched it; else the checkpoint."""
        restored = self._resume_from_snapshot()
        if restored is not None:
            return restored
        if saves.latest_complete(self.url) is None:
            torch.manual_seed(self.spec.training.seed)
            return 0
        t0 = time.perf_counter()
        latest = ckpt.load_intact(self.url, self.parts, self.opts, on_damaged=self._damaged)
        if latest is None:
            if self.rank == 0:  # noqa: SIM102 (the first rank of the job says it once)
                log.error(f"NO INTACT CHECKPOINT in {self.url}: every complete save is damaged (see the DAMAGED "
                          f"file in each). Restore them, or point training.checkpoint.dir elsewhere to start over.")
            raise RankExit(EXIT_NO_CHECKPOINT)
        meta = saves.read_meta(self.url, latest)
        if self.rank == 0:
            failed = self._restore_point().get("failed_after_step")
            log.info(f"resumed from {saves.step_dir(self.url, latest)} (step {latest}, layout "
                     f"{meta['layout'].get('label', meta['layout'])} -> {self.lay['label']}) in "
                     f"{time.perf_counter() - t0:.2f} s"
                     + (f"; {max(failed - latest, 0)} step(s) lost" if isinstance(failed, int) else ""))
        buf = np.frombuffer(base64.b64decode(meta["rng_state"]), dtype=np.uint8).copy()
        torch.random.set_rng_state(torch.from_numpy(buf))  # every rank continues rank 0's stream
        return meta["step"]

    def _resume_from_snapshot(self) -> int | None:
        """The snapshot the launcher chose (its keepers' inventories, keeper.restore_point), loaded
        by every rank of this world, resharded into this layout; None: none chosen, or some rank
        could not fetch it (every rank then reads the checkpoint)."""
        point = self._restore_point()
        if point.get("source") != "snapshot":
            return None
        t0 = time.perf_counter()
        path, meta, why = None, None, ""
        try:
            path, meta = ckpt.fetch_snapshot(point, wire.read_secret(os.environ[keeper.ENV_KEEPER_KEY_FILE]))
        except Exception as e:  # noqa: BLE001 - a keeper gone since the launcher asked: the checkpoint instead
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        fetched_s = time.perf_counter() - t0
        everyone = world.host_reduce([0.0 if meta is None else 1.0], dist.ReduceOp.MIN)[0]
        if everyone < 1.0:
            if path is not None:
                ckpt.drop_memory(path)
            log.warning(f"SNAPSHOT NOT USED: the memory snapshot of step {point['step']} could not be fetched by every "
                        f"rank{' (this one: ' + why + ')' if why else ''}; resuming from the checkpoint instead")
            return None
        ckpt.load_dir(path, self.parts, self.opts)
        ckpt.drop_memory(path)
        if self.rank == 0:
            lost, dcp_step = point.get("failed_after_step"), point.get("checkpoint_step")
            log.info(f"resumed from the memory snapshot of step {meta['step']} held by the keepers "
                     f"{sorted({a for h in point['holders'].values() for a in h})} (layout "
                     f"{meta['layout'].get('label', meta['layout'])} -> {self.lay['label']}) in "
                     f"{time.perf_counter() - t0:.2f} s (fetched in {fetched_s:.2f} s)"
                     + (f"; {max(lost - meta['step'], 0)} step(s) lost" if isinstance(lost, int) else "")
                     + (f", the newest checkpoint is step {dcp_step}" if dcp_step is not None else
                        ", no checkpoint on the file system"))
        buf = np.frombuffer(base64.b64decode(meta["rng_state"]), dtype=np.uint8).copy()
        torch.random.set_rng_state(torch.from_numpy(buf))  # as a checkpoint's resume: rank 0's stream
        return meta["step"]

    def _restore_point(self) -> dict:
        """Where the launcher said this restart resumes from (keeper.RESTORE_JSON; {}: not said)."""
        f = self.plan_dir / keeper.RESTORE_JSON
        return json.loads(f.read_text()) if f.exists() else {}

    def _snapshot(self, step: int) -> None:
        """This rank's state after `step` into host memory, handed to its own node's keeper and its
        buddy's in the background (the one before finished first)."""
        self._snapshot_done()
        keepers = os.environ[keeper.ENV_KEEPERS].split(",")
        node = int(os.environ.get("GROUP_RANK", 0)) % len(keepers)
        self._pending_snapshot = ckpt.snapshot(step, self.parts, self.opts, self._meta(step), dist.get_rank(),
                                               dist.get_world_size(), self._snap_group,
                                               [keepers[n] for n in keeper.buddies(node, len(keepers))],
                                               self._keeper_key, self.attempt)

    def _snapshot_done(self) -> None:
        """Wait for the snapshot in flight (if any); say how it went (rank 0, or a rank it failed on)."""
        p, self._pending_snapshot = self._pending_snapshot, None
        if p is None:
            return
        p.finish()
        if p.error and p.error not in self._snapshot_warned:  # each distinct failure once (a lost buddy: every time)
            self._snapshot_warned.add(p.error)
            log.warning(f"SNAPSHOT of step {p.step}: {p.error}" + ("; a restart reads the checkpoint" if not p.held else
                        f"; held by {p.held} keeper(s), a restart reads it while they live"))
        elif not p.error and self.rank == 0:
            log.info(f"snapshot of step {p.step} held in memory by its keepers: staged in {p.staged_s * 1e3:.1f} ms "
                     f"(blocking), written and sent in {p.sent_s * 1e3:.1f} ms (background)")

    def _damaged(self, step: int, problems: list[str]) -> None:
        log.warning(f"CHECKPOINT DAMAGED: step {step} in {saves.step_dir(self.url, step)}: {'; '.join(problems[:3])}"
                    f"{' ...' if len(problems) > 3 else ''}; marked DAMAGED, trying the previous one")
        events.record(self.run_dir, {"mode": "checkpoint_damaged", "step": step, "problems": problems,
                                     "attempt": self.attempt})

    def train_step(self, step: int) -> float | None:
        """One optimizer step over this rank's share of the global batch; the mean loss, or None
        when the copies re-formed instead (the new generation then finishes the step: from the kept
        gradients with only the lost copies' micro-batches recomputed, `_recompute`, or redone whole)."""
        t0 = time.perf_counter()
        self._slow_if_injected(step)
        rec, self._recover = self._recover, None
        local = self._forward_backward(step) if rec is None else self._recompute(step, rec)
        if self.replicas is not None:  # this copy's own work (its straggler measure, launch/stragglers.py)
            return self._commit_across_copies(step, local, time.perf_counter() - t0)
        if self.experts is not None:
            self.experts.scale_grads()
        self._clip()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.experts is not None:
            self.expert_stats = self.experts.after_step()
        # The mean over every micro-batch of the step: each rank that computed a loss (all TP
        # ranks of the last stage agree) weighs by its micro-batches.
        total, count = world.host_reduce(self._loss_terms(local))
        return total / count

    def _clip(self) -> None:
        """The gradients' global norm (every stage, shard and expert) clipped at training.max_norm,
        before the optimizer steps (train/parallel.clip_grad_norm); nothing when it is 0."""
        if self.max_norm > 0:
            pp = self.meshes["dense"]["pp"].get_group() if self.lay["pp"] > 1 else None
            self._grad_norm = clip_grad_norm(self.parts, self.max_norm, pp)

    def _loss_terms(self, local: float | None) -> list[float]:
        return [local * self._real, float(self._real)] if local is not None else [0.0, 0.0]

    def _forward_backward(self, step: int) -> float | None:
        """Forward and backward over this rank's micro-batches; their mean loss (None off the last
        stage). With an uneven split (training.uneven_batch) each micro-batch weighs dp / M of the
        step's M, so summed over the replicas the update is the full batch's; a rank with one
        fewer runs a padding micro-batch (labels IGNORE) where the others' collectives need it."""
        tr, dp, b = self.spec.training, self.lay["dp"], self.spec.training.micro_batch
        M = tr.global_batch // b
        _, self._real = share(M, dp, self.dp_rank)
        in_step = self.schedule is not None or self.lay["dp_shard"] > 1  # peers count my micro-batches
        run = self.lay["microbatches"] if in_step else self._real
        idx = self.data.indices(step, tr.global_batch, dp, self.dp_rank, b)
        self._record_samples(step, idx)
        self._loss_scale = dp / M * self.lay["microbatches"]  # torch's schedule divides by its count
        total = self._microbatches(idx, run, self._real, dp / M, self.schedule)
        return None if total is None else total / self._real

    def _recompute(self, step: int, rec: dict) -> float | None:
        """The new generation's pass for the step in flight when the survivors kept their gradients
        (reform): the kept ones rescaled to its weight (new dp / old dp: each micro-batch weighs
        dp / M, the all-reduce divides by the copies), zeros on a copy new to it, then only this data
        rank's share of the lost copies' micro-batches (plan/split.py) at the new weight, accumulated
        onto them (FSDP2 adds a reduce-scatter to the sharded gradient it holds). Every rank of a copy
        runs the copy's count (padding micro-batches where its collectives count them); with pipeline
        stages, on a schedule of its own for that count. The loss terms are the kept and the new
        ones together: the committed loss is the full batch's."""
        tr, dp, b = self.spec.training, self.lay["dp"], self.spec.training.micro_batch
        M = tr.global_batch // b
        keep_grads(self.parts, dp / rec["old_dp"], rec["holds"])
        idx = [step * tr.global_batch + j * b + k for j in rec["ids"] for k in range(b)]
        if rec["holds"]:
            self._record_samples(step, rec["kept_idx"], kept=True)  # the new attempt's record of the whole step
        self._record_samples(step, idx, recomputed=True)
        in_step = self.schedule is not None or self.lay["dp_shard"] > 1
        run = rec["run"] if in_step else len(rec["ids"])
        schedule = None
        if self.schedule is not None and run:
            from orchestrator.train.pipeline import build_schedule

            asked = run
            schedule, _, run = build_schedule(self.plan, self.parts, self.meshes["dense"], self.device,
                                              lambda out, y: loss_fn(out, y) * self._loss_scale, run,
                                              scale_grads=False)
            if run > asked and self.leader:
                log.info(f"the recovery pass runs {run} micro-batches on {type(schedule).__name__}, which takes no "
                         f"fewer than {run} here: {run - asked} of them padding (labels ignored)")
            self._loss_scale = dp / M
        total = self._microbatches(idx, run, len(rec["ids"]), dp / M, schedule) if run else (
            0.0 if self.has_last else None)
        kept_sum, kept_count = rec["terms"]
        self._real = int(kept_count) + len(rec["ids"])
        if total is None or not self._real:
            return None
        return (kept_sum + total) / self._real

    def _record_samples(self, step: int, idx: list[int], **mark) -> None:
        if self.records:
            with open(self.run_dir / rundir.SAMPLES / f"rank{self.rank}.jsonl", "a") as f:
                f.write(rundir.dumps({"step": step, "attempt": self.attempt, "dp_rank": self.dp_rank,
                                      "indices": idx, **mark}, indent=None) + "\n")

    def _microbatches(self, idx: list[int], run: int, real: int, weight: float, schedule) -> float | None:
        """Forward and backward over the samples `idx` (`real` micro-batches) and `run - real`
        padding ones, each weighing `weight`; the sum of the real ones' losses (None off the last stage)."""
        cp, b = self.lay["cp"], self.spec.training.micro_batch
        src = self.data.batch(idx if idx else [0])  # (a rank with only padding pads with any sample)
        tokens = src if idx else src[:0]
        labels = tokens[:, 1:].clone()
        if run > real:
            pad = (run - real) * b
            tokens = torch.cat([tokens, src[:1].expand(pad, -1)])
            labels = torch.cat([labels, torch.full((pad, labels.shape[1]), IGNORE, dtype=labels.dtype)])
        tokens, labels = tokens.to(self.device), labels.to(self.device)
        inputs = cp_shard(tokens[:, :-1], cp, self.coords["cp"])
        labels = cp_shard(labels, cp, self.coords["cp"])
        total = None
        with loss_parallel() if self.lay["tp"] > 1 else contextlib.nullcontext():
            if schedule is not None:
                losses: list = []
                args = (inputs,) if self.has_first else ()
                kw = {"target": labels, "losses": losses} if self.has_last else {}
                schedule.step(*args, **kw)
                if self.has_last:
                    total = sum(_scalar(x) for x in losses) / self._loss_scale
            else:
                model = self.parts[0][1]
                total = 0.0
                sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's root (dp_shard x cp > 1)
                for k in range(run):
                    if sync is not None:  # accumulate unsharded; reduce-scatter once, after the last micro-batch
                        sync(k == run - 1)
                    loss = loss_fn(model(inputs[k * b:(k + 1) * b]), labels[k * b:(k + 1) * b])
                    (loss * weight).backward()
                    total += _scalar(loss)
        return total

    def _commit_across_copies(self, step: int, local: float | None, busy_s: float) -> float | None:
        """Average the gradients across the copies, then step only if every copy can: the
        coordinator grants the commit once all asked, so no copy is ever a step ahead."""
        rep = self.replicas
        stop = 1.0 if self.should_stop is not None and self.should_stop() else 0.0
        agg = torch.tensor([*self._loss_terms(local), stop], dtype=torch.float64)
        ok, write_back = True, None
        world.beat(self.run_dir, step, "wait", self.rank)  # from here on it waits on the other copies
        try:
            write_back = sync_replicas(self.parts, lambda flat: rep.all_reduce(rep.replica, flat), len(rep.copies))
        except RuntimeError as e:  # a copy is gone (aborted by the coordinator, or found out: a reset, a timeout)
            ok = False
            if self.leader:
                log.info(f"step {step + 1}: cross-copy collective left: {str(e).splitlines()[0][:300]}")
        if not ok:  # drop the groups now, so every peer learns it fast (outside the except: its
            rep.drop()  # traceback holds the group, whose destructor would then run on this thread)
        saving, self._saved = self._saved or self._saving, False
        answer = rep.commit(step, ok, agg, busy_s, saving)  # the loss and stop flag cross copies through the leaders
        if answer["op"] == "commit":
            write_back()  # the average over the copies, only now that every copy commits
            self._clip()  # of the average: every copy computes the same norm
            for opt in self.opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            self._stop_flag = bool(answer["stop"])
            return answer["loss"]
        self._kept = None
        if answer.get("kept"):  # this copy's own gradients of the step (never the average) stay for the pass
            self._kept = {"step": step, "terms": self._loss_terms(local), "dp_rank": self.dp_rank}
        else:
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
        self.reform(answer)
        return None

    def reform(self, answer: dict) -> None:
        """Go on in the next generation: its plan (data split, micro-batches), its groups, and
        for copies new to it, the model and optimizer state of a healthy copy."""
        if answer["op"] != "reform":
            log.info(f"copy {self.place.copy} leaves the run: {answer.get('reason', '')}")
            raise RankExit(EXIT_LEFT)
        old_dir, old_plan = str(self.plan_dir), self.plan
        self.plan_dir = Path(answer["plan_dir"])
        self.plan = RunPlan.load(self.plan_dir)
        self.lay = self.plan.layout
        self.attempt = rundir.attempt_number(self.plan_dir, self.run_dir) or 0
        self.replicas.build(answer["gen"], answer["copies"])
        self._layout_shaped()
        kept, self._recover = answer.get("kept"), None
        if kept:  # the step in flight is finished from the kept gradients (launch/inplace.keeps decided it)
            old = old_plan if kept["plan_dir"] == old_dir else RunPlan.load(Path(kept["plan_dir"]))
            self._recover = self._recovery(answer, kept, old.layout)
        self._kept = None
        new = answer.get("new", [])
        if new:
            if self.place.copy in new:
                self._init_optimizer_state()
            source = next(i for i, c in enumerate(answer["copies"]) if c not in new)
            self.replicas.broadcast_state(self._state_tensors(), source)
        if self.leader:
            rec = self._recover
            log.info(f"generation {answer['gen']}: copies {answer['copies']} ({self.lay['label']}), going on at "
                     f"step {answer['step']}" + (f"; copies {new} received the state of copy "
                                                 f"{answer['copies'][source]}" if new else "")
                     + (f"; the step in flight finished from the kept gradients: {rec['lost']} lost micro-batch(es) "
                        f"recomputed, {rec['run']} by this copy's ranks" if rec else
                        "; the step in flight redone whole"))

    def _recovery(self, answer: dict, kept: dict, old_lay: dict) -> dict:
        """This rank's recovery pass (every rank computes the same assignment from the old generation's
        plan, the lost copies' places in it, and the new copy list): the lost copies' micro-batches
        spread over the new generation's data ranks in order (plan/split.py), and whether this rank
        holds its own gradients of the step (every copy of the new generation but the new ones)."""
        tr, step = self.spec.training, answer["step"]
        M = tr.global_batch // tr.micro_batch
        lost = lost_microbatches(M, old_lay["dp"], old_lay["dp_shard"], kept["lost"])
        holds = self.place.copy not in answer.get("new", [])
        mine = self._kept
        if holds and (mine is None or mine["step"] != step):
            raise RankExit(EXIT_FAILED, f"copy {self.place.copy} holds no gradients of step {step} to keep "
                                        f"(it has {None if mine is None else mine['step']}); restarting")
        return {"step": step, "old_dp": old_lay["dp"], "holds": holds, "lost": len(lost),
                "ids": recompute_share(lost, self.lay["dp"], self.dp_rank),
                "run": recompute_run(len(lost), self.lay["dp"], self.lay["dp_shard"], self.replicas.index),
                "terms": mine["terms"] if holds else [0.0, 0.0],
                "kept_idx": self.data.indices(step, tr.global_batch, old_lay["dp"], mine["dp_rank"], tr.micro_batch)
                if holds else []}

    def _init_optimizer_state(self) -> None:
        """A newcomer's optimizer state, shaped like everyone's (its values arrive next)."""
        for (_, part), opt in zip(self.parts, self.opts):
            for p in part.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def _state_tensors(self) -> list[torch.Tensor]:
        """This rank's parameters and optimizer state, in the same order on every copy."""
        out = []
        for (_, part), opt in zip(self.parts, self.opts):
            for p in part.parameters():
                out.append(p.data.to_local() if isinstance(p.data, DTensor) else p.data)
                for key in sorted(opt.state.get(p, {})):
                    t = opt.state[p][key]
                    if isinstance(t, torch.Tensor):
                        out.append(t.to_local() if isinstance(t, DTensor) else t)
        return out

    def save(self, step: int, pending, fault=None):
        """A checkpoint after `step` (asynchronous when configured); the save still in flight."""
        c = self.spec.training.checkpoint
        if pending is not None:
            pending.finish()
        pending = ckpt.save(self.url, step, self.parts, self.opts, self._meta(step), dist.get_rank(), keep=c.keep,
                            fault_hook=fault, asynchronous=c.async_save, group=self._ckpt_group)
        return pending if c.async_save else None

    def run(self) -> dict:
        """Train to training.steps (or until should_stop() on any rank: save, return)."""
        self.setup()
        self.build()
        (self.run_dir / rundir.SAMPLES).mkdir(exist_ok=True)
        tr = self.spec.training
        if self.joining:  # wait, warm, to be admitted; then take a healthy copy's state
            start = self._join()
        else:
            start = self.resume()
            if self.replicas is not None:
                self.replicas.build(0, self.replicas.copies)
        every = tr.checkpoint.every
        self._ckpt_group = dist.new_group(backend="gloo") if every and tr.checkpoint.async_save else None
        snap_every = keeper.every_of(self.plan.data) if os.environ.get(keeper.ENV_KEEPERS) else 0
        if not snap_every and keeper.every_of(self.plan.data) and self.rank == 0:
            log.warning(f"no memory snapshots: the plan takes one every {keeper.every_of(self.plan.data)} step(s) but "
                        f"this launcher runs no snapshot keepers ({keeper.ENV_KEEPERS} unset; launcher=local and slurm do): "
                        f"a restart reads the checkpoint")
        self._snap_group = dist.new_group(backend="gloo") if snap_every else None  # the snapshots' own (background)
        self._keeper_key = wire.read_secret(os.environ[keeper.ENV_KEEPER_KEY_FILE]) if snap_every else None
        fault = self._fault_hook()
        metrics = Logger(self.run_dir, self.plan)
        profiler = StepProfiler(self.run_dir, tr.steps, self.leader, self.lay)  # the last two steps, rank 0
        pending, step = None, start
        while step < tr.steps:
            self._fault_if_injected(step)
            world.beat(self.run_dir, step, "begin", self.rank)
            t0 = time.perf_counter()
            self._saving = pending is not None  # an asynchronous save in flight shares this copy's step
            loss = profiler.run(step, lambda: self.train_step(step))
            if loss is None:
                continue  # re-formed: the new generation finishes this step (kept gradients) or redoes it
            dt = time.perf_counter() - t0
            world.beat(self.run_dir, step, "end", self.rank)
            self._record(metrics, step, loss, dt, profiler.profiled(step))
            saver = self.replicas is None or self.replicas.index == 0  # one copy writes the checkpoint
            if saver and every and ((step + 1) % every == 0 or step + 1 == tr.steps):
                self._snapshot_done()  # every rank's snapshot before is held before a save can fail
                pending = self.save(step + 1, pending, fault if fault and step + 1 == fault.step else None)
                self._saved = True  # the next step's commit says so: its wait on this copy is the save's
            elif saver and snap_every and (step + 1) % snap_every == 0 and step + 1 < tr.steps:
                self._snapshot(step + 1)
            if self._stop_requested(step):
                self._snapshot_done()
                if pending is not None:
                    pending.finish()
                    pending = None
                if saver and saves.latest_complete(self.url) != step + 1:
                    self.save(step + 1, None)
                if self.leader:
                    log.info(f"stopping after step {step + 1} on request (preemption or time limit); "
                             f"checkpoint saved")
                self.history["stopped"] = True
                break
            step += 1
        self._snapshot_done()
        if pending is not None:
            pending.finish()
        if self.replicas is not None:
            self.replicas.finish()  # the leader's bye: its connection closing is not a loss
        metrics.close()
        self._finish(start)
        return self.history

    def _join(self) -> int:
        answer = self.replicas.ask({"op": "join", "now": os.environ.get(rundir.ENV_JOIN_NOW) == "1"})
        self.reform(answer)
        return answer["step"]

    # ---- fault injection (fault.*, from this process's plan; the launcher kills nodes itself) --
    def _fault_hook(self):
        """fault.mode=during_save with a node killed (the first attempt): on every rank of that
        node, the hook that kills it in the middle of the save after the fault's step."""
        f = self.spec.fault
        if (self.launched_attempt != 0 or self.fault_step is None or f.kind != FaultKind.kill_node
                or f.mode != FaultMode.during_save):
            return None
        if self.rank // self.spec.hardware.gpus_per_node != int(f.nodes()[0]):
            return None
        return _Fault(self.fault_step)

    def _slow_if_injected(self, step: int) -> None:
        """fault.kind=slow_node: every rank of the slow node spends fault.slow_s more on each step
        from the fault's step on, whatever the attempt (the node stays slow). The node is the
        physical one the launcher put this process on (GROUP_RANK): a spare is not slow."""
        f = self.spec.fault
        if (f.kind == FaultKind.slow_node and self.fault_step is not None and step >= self.fault_step
                and os.environ.get("GROUP_RANK") == str(f.nodes()[0])):
            time.sleep(float(f.slow_s))

    def _fault_if_injected(self, step: int) -> None:
        """fault.kind=crash_rank | segfault_rank | hang_rank, the first attempt only (what runs after the
        recovery is healthy): global rank fault.rank fails as a GPU fault would (an error, or a fatal
        signal in native code), or stops making progress
        (its peers then block in the step's first collective); its node stays up."""
        f = self.spec.fault
        if (f.kind in RANK_KINDS and self.launched_attempt == 0
                and self.attempt == 0 and f.rank == self.rank and self.fault_step == step):
            _fail_rank(f.kind, self.rank, step)

    # ---- helpers --------------------------------------------------------------------------
    def _stop_requested(self, step: int) -> bool:
        if self.should_stop is None or step + 1 >= self.spec.training.steps:
            return False
        if self.replicas is not None:  # agreed across copies in the step's own all-reduce
            return self._stop_flag
        return world.host_reduce([1.0 if self.should_stop() else 0.0], dist.ReduceOp.MAX)[0] > 0

    def _record(self, log: Logger, step: int, loss: float, dt: float, profiled: bool = False) -> None:
        tr, plan = self.spec.training, self.plan
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        if self.device.type == "cuda":
            mine = torch.cuda.max_memory_allocated(self.device) / 2**20
        rss = [x[0] for x in world.host_gather([mine])]  # this world: the job's, or with copies, this copy's
        moe = self._expert_scalars()
        self.history["loss"].append(loss)
        self.history["step_time_s"].append(dt)
        # the global gradient norm before the clip (the same on every rank), where the step clips
        norm = {} if self._grad_norm is None else {"grad_norm": float(self._grad_norm)}
        if norm:
            self.history.setdefault("grad_norm", []).append(norm["grad_norm"])
        mfu = measured_mfu(plan.data, dt)
        log.step(step, tr.steps, {
            "loss/train": loss, "time/step_s": dt, "throughput/tokens_per_s": tr.global_batch * tr.seq_len / dt,
            "perf/tflops_per_gpu": mfu * self.spec.hardware.peak_tflops,
            "perf/tflops_per_gpu_predicted": plan.predicted_tflops_per_gpu, "perf/mfu": mfu,
            "perf/mfu_predicted": plan.predicted_mfu, "time/step_s_predicted": plan.predicted_step_s,
            "memory/max_rss_mb": max(float(x) for x in rss),
            # per rank (peak host RSS on CPU, peak allocated device memory on GPU), the first 64 ranks
            **{f"memory/rank{r}_mb": float(x) for r, x in enumerate(rss[:64])},
            **moe, **({"grad/norm": norm["grad_norm"]} if norm else {}),
        }, line=(step + 1) % max(tr.log_every, 1) == 0 or step + 1 == tr.steps, enabled=self.leader)
        if self.leader:
            with open(self.run_dir / rundir.METRICS_JSONL, "a") as f:
                f.write(rundir.dumps({"step": step, "loss": loss, "step_time_s": dt, "attempt": self.attempt,
                                      "dp": self.lay["dp"], "time": time.time(), **norm,
                                      **({rundir.PROFILED: True} if profiled else {})}, indent=None) + "\n")

    def _expert_scalars(self) -> dict:
        """Load balance and all-to-all traffic of the step (collective: every rank's bytes)."""
        st = self.expert_stats
        if st is None:
            return {}
        ranks = world.host_gather([float(st["bytes"]), float(st["seconds"])])
        self.history.setdefault("ep_bytes_per_rank", []).append([float(x[0]) for x in ranks])
        out = {"comm/ep_all_to_all_bytes_max": max(float(x[0]) for x in ranks),
               "time/ep_all_to_all_s_max": max(float(x[1]) for x in ranks)}
        ep = self.plan.axis("ep")
        if ep is not None:
            out["comm/ep_all_to_all_bytes_predicted"] = ep["bytes_per_step"]
        load = st["load"]
        for layer in range(load.shape[0]):
            row = load[layer]
            if row.sum() == 0:
                continue  # a dense layer
            out[f"moe/imbalance/layer{layer}"] = float(row.max() / row.mean())  # busiest expert / mean
            if load.shape[1] <= 64:
                out.update({f"moe/tokens/layer{layer}/expert{e}": float(x) for e, x in enumerate(row)})
        return out

    def _meta(self, next_step: int) -> dict:
        """What a checkpoint records besides tensors: data position, RNG state, shape, batch and plan."""
        tr = self.spec.training
        rng = base64.b64encode(torch.random.get_rng_state().numpy().tobytes()).decode()
        return {"step": next_step, "rng_state": rng, "samples_consumed": next_step * tr.global_batch,
                "model": self.plan.config_json["model"],  # as plan.json holds it
                "training": {k: getattr(tr, k) for k in ("global_batch", "seq_len", "seed")},
                "layout": {k: self.lay[k] for k in ("tp", "cp", "pp", "dp", "vp", "schedule", "label")},
                "plan": self.plan.data}

    def _finish(self, start: int) -> None:
        if self.leader:
            rundir.write_json(self.run_dir / rundir.METRICS_JSON, {
                "loss": self.history["loss"], "step_time_s": self.history["step_time_s"], "start_step": start,
                **({k: self.history[k] for k in ("ep_bytes_per_rank", "grad_norm") if k in self.history}),
                "attempt": self.attempt,
                "layout": {k: self.lay[k] for k in ("tp", "cp", "pp", "dp", "vp", "schedule")},
            }, indent=1)
        dist.barrier()  # DCP and gloo exit cleanly only after everyone is done (torch 2.13, gloo:
        # without it about half of 4-rank runs aborted at exit in DCP's teardown)
        dist.destroy_process_group()


class _Fault:
    """Fault injection (fault.mode=during_save): every rank of the victim node kills
    itself in the middle of the save at `step`, as a node would die."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self):
        import signal

        log.warning(f"fault injection: killing this node during the save of step {self.step}")
        os.kill(os.getpid(), signal.SIGKILL)


def _fail_rank(kind: FaultKind, rank: int, step: int) -> None:
    log.warning(f"fault injection: rank {rank} {'hangs' if kind == FaultKind.hang_rank else 'crashes'} before "
                f"step {step + 1}")
    if kind == FaultKind.crash_rank:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected: fault.kind=crash_rank)")
    if kind == FaultKind.segfault_rank:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)  # the default action: the process dies, faulthandler's stack in its log
    while True:
        time.sleep(3600)

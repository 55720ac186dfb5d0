"""torchtitan's command line from a plan, what torchtitan cannot run, and its rank order:
the part its release lines share; each line's command line in its own module (v0_2, v0_3).

Release lines (LINES): 0.2 (torchtitan==0.2.0: JobConfig, --job.config_file) and 0.3
(torchtitan==0.3.0: a config registry per model, --module/--config). The line is chosen where
the ranks run: `trainer.version` if given, else the release installed for the interpreter that
starts the ranks (frameworks/trainers.release), asked at launch. Checked against both releases'
own code by tests/test_trainers.py (ConfigManager().parse_args on every rendered line,
ParallelDims(...).build_mesh() under torch's fake process group for every rank, the pipeline
split functions). Sources, the same in both lines unless said:
  pp.py = torchtitan/distributed/pipeline_parallel.py (stage split, stages per rank)
  pd.py = torchtitan/distributed/parallel_dims.py (the device mesh: pp, dp_replicate,
          dp_shard, cp, tp outermost first; EP carved from dp_shard x cp [x tp])
  llama3 = torchtitan/models/llama3/infra/parallelize.py (0.2), models/llama3/parallelize.py (0.3)
"""
from __future__ import annotations

import math
from pathlib import Path

from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, Precision, Recompute, clip_norm
from orchestrator.config.schedules import SCHEDULES
from orchestrator.plan.layout import Layout
from orchestrator.frameworks.torchtitan import v0_2, v0_3

LINES = {m.LINE: m for m in (v0_2, v0_3)}
DEFAULT = v0_3.LINE  # the current release, rendered for when nothing says which is installed
VERSION_QUERY = "import importlib.metadata as m; print(m.version('torchtitan'))"
STACKS = ("torchtitan",)
# torch.distributed.pipelining's get_schedule_class names, as torchtitan takes them
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                  "zero_bubble": "InterleavedZeroBubble", "dualpipev": "DualPipeV"}
SINGLE_STAGE = ("GPipe", "1F1B")  # PipelineScheduleSingle: exactly one stage per rank (pp.py:94-99)
MESH = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # pd.py _build_mesh_without_ep, outermost first


def split(stages: int, layers: int, first_less: int, last_less: int) -> list[int] | None:
    """Layers per virtual stage as torchtitan's generate_llm_fqn_per_model_part deals them
    (pp.py:226-333): the embedding and the output count as `first_less` and `last_less`
    layers, the remainder goes to the first stages. None where torchtitan raises."""
    eff = layers + first_less + last_less
    per, extra = divmod(eff, stages) if stages else (0, 0)
    if stages > eff or per == 0 or first_less > per or last_less > per:
        return None
    out, cur = [], 0
    for i in range(stages):
        n = per + (1 if i < extra else 0) - (first_less if i == 0 else last_less if i == stages - 1 else 0)
        n = max(min(n, layers - cur), 0)
        out.append(n)
        cur += n
    return out if cur == layers else None


def stage_settings(plan_layers: list[int], pp: int, layers: int, schedule: str) -> dict | None:
    """The pipeline settings under which torchtitan splits the model as the plan does
    ({} for its defaults), or None when none does."""
    single = SCHEDULE_NAMES[schedule] in SINGLE_STAGE
    stages = len(plan_layers)
    for lps in [None] + list(range(1, layers + 3)):
        if lps is None:
            n = pp * (1 if single else 2)  # pp.py:108-113: the default stages per rank
        else:
            n = None  # set per (first, last) below
        for first in (1, 0, 2, 3):
            for last in (1, 0, 2, 3):
                count = n if lps is None else math.ceil((layers + first + last) / lps)  # pp.py:72-74
                if count != stages or count % pp or (single and count != pp) or (not single and count < 2 * pp):
                    continue
                if split(count, layers, first, last) == plan_layers:
                    out = {}
                    if first != 1:
                        out["pipeline_parallel_first_stage_less_layers"] = first
                    if last != 1:
                        out["pipeline_parallel_last_stage_less_layers"] = last
                    if lps is not None:
                        out["pipeline_parallel_layers_per_stage"] = lps
                    return out
    return None


def problems(spec: Config, layout: Layout) -> list[Problem]:
    out, tr = [], spec.training
    sched, module_names = layout.schedule.name, False
    if layout.pp > 1:
        if sched not in SCHEDULE_NAMES:
            out.append(Problem("schedule.name", f"torchtitan has no {sched} schedule (it runs torch's "
                               f"{sorted(SCHEDULE_NAMES.values())}).",
                               "use schedule=dualpipev (DualPipe's one-copy variant) or schedule=interleaved_1f1b."))
        elif sched == "zero_bubble":
            out.append(Problem("schedule.name", "torchtitan runs InterleavedZeroBubble (a multi-stage schedule) with "
                               "at least 2 stages per rank (pp.py:101-106); the plan's zero_bubble has one.",
                               "use schedule=dualpipev, or schedule=interleaved_1f1b layout.vp=2."))
        else:
            counts = [b - a for a, b in layout.virtual_stages()]
            module_names = stage_settings(counts, layout.pp, spec.model.layers, sched) is None
    if line_of(spec.trainer.version) in LINES:  # else the launcher checks the installed line before it renders
        out += LINES[line_of(spec.trainer.version)].problems(spec, layout, module_names)
    if layout.cp > 1 and spec.stack.cp_comm.value == "a2a":
        out.append(Problem("stack.cp_comm", "torchtitan's context parallelism is torch's (torch.distributed.tensor."
                           "experimental context_parallel): it passes K/V shards between the ranks (all-gather, or "
                           "0.2's ring), it has no Ulysses all-to-all of heads (cp_comm=a2a).",
                           "set stack.cp_comm=all_gather (torchtitan's default), or p2p with trainer.version=0.2."))
    if layout.zero == 1:
        out.append(Problem("layout.zero", "torchtitan shards parameters, gradients and optimizer state together "
                           "(FSDP2) or nothing (DDP); zero=1 shards only the optimizer.",
                           "use layout.zero=2 (fsdp_reshard_after_forward=never) or 3."))
    if layout.zero == 0 and (layout.tp > 1 or layout.cp > 1 or layout.pp > 1):
        out.append(Problem("layout.zero", "torchtitan's DDP (zero=0) runs without TP, CP or PP "
                           "(llama3 parallelize: 'DDP has not supported > 1D parallelism').", "use layout.zero=2 or 3."))
    if layout.tp > 1 and not spec.layout.sequence_parallel:
        out.append(Problem("layout.sequence_parallel", "torchtitan always shards the sequence with TP.",
                           "set layout.sequence_parallel=true."))
    if layout.ep > 1 and layout.etp not in (1, layout.tp):
        out.append(Problem("layout.etp", f"torchtitan runs experts with etp=1 or etp=tp (pd.py), got {layout.etp}.",
                           "set layout.etp=1."))
    if spec.clip_norm() == 0:
        out.append(Problem("training.max_norm", f"torchtitan clips the gradients' global norm every step at "
                           f"training.max_norm (dist_utils.clip_grad_norm_ in every step: train.py in 0.2, trainer.py "
                           f"in 0.3); "
                           f"0 would scale every gradient to 0, and it has no setting that turns the clip off "
                           f"(training.max_norm={tr.max_norm}, stack.grad_clip={spec.stack.grad_clip}).",
                           "set training.max_norm > 0 (torchtitan's default is 1.0; a large value such as 1e9 "
                           "computes the norm and never clips) with stack.grad_clip=true."))
    if tr.recompute == Recompute.full and tr.recompute_layers is not None:
        out.append(Problem("training.recompute_layers", "torchtitan recomputes every block (mode=full) or every "
                           "N-th (selective_ac_option=N), not the first N of each chunk.",
                           "unset training.recompute_layers."))
    if spec.stack.cross_entropy.value not in ("torch", "inductor"):
        out.append(Problem("stack.cross_entropy", f"torchtitan's loss is torch's cross_entropy, eager or compiled; the "
                           f"plan prices {spec.stack.cross_entropy.value}'s kernels.",
                           "set stack.cross_entropy=torch (eager) or inductor (torch.compile'd with the model)."))
    if layout.tp > 1 and spec.stack.tp_overlap > 0 and not spec.stack.fused_elementwise:
        out.append(Problem("stack.tp_overlap, stack.fused_elementwise", f"async TP (stack.tp_overlap="
                           f"{spec.stack.tp_overlap}) runs only on a torch.compile'd model in torchtitan (0.2: "
                           f"maybe_enable_async_tp, 0.3: CompileConfig refuse it without 'model' in "
                           f"compile.components); the plan prices an eager one.",
                           "set stack.fused_elementwise=true (the model compiled), or stack.tp_overlap=0."))
    if tr.precision in (Precision.mxfp8, Precision.nvfp4):
        out.append(Problem("training.precision", f"the rendering has no {tr.precision.value} arguments (it "
                           f"writes --model.converters=float8 for fp8).", "put torchtitan's MX converter "
                           "arguments in trainer.args with training.precision=fp8, or use trainer=command."))
    return out


def line_of(version: str | None) -> str | None:
    """The release line of a version ('0.3.0', '0.3.1.dev0', '0.3' -> '0.3'); None for None."""
    if not version:
        return None
    return ".".join(str(version).strip().split(".")[:2])


def version_problems(version: str | None) -> list[Problem]:
    """trainer.version must name a release line the renderer has (schema validation)."""
    if version is None or line_of(version) in LINES:
        return []
    return [Problem("trainer.version", f"torchtitan {version!r} is not a release line the launcher renders for "
                    f"(it renders for {', '.join(LINES)}).", f"set trainer.version to one of {', '.join(LINES)}, "
                    f"or leave it unset to use the release installed where the ranks run.")]


def _counts(lay: dict) -> list[int]:
    """Layers per virtual stage, in pipeline order."""
    virtual = sorted((v for st in lay["stages"] for v in st["virtual"]), key=lambda v: v["stage"])
    return [v["layers"][1] - v["layers"][0] for v in virtual]


def module_parts(plan_json: dict, line: str = DEFAULT) -> list[list[str]] | None:
    """The plan's split as torchtitan's module_fqns_per_model_part (tok_embeddings, layers.N,
    norm and the line's output module), where its split settings cannot give it."""
    lay = plan_json["layout"]
    if lay["pp"] == 1 or lay["schedule"] not in SCHEDULE_NAMES:
        return None
    counts, layers = _counts(lay), plan_json["config"]["model"]["layers"]
    if stage_settings(counts, lay["pp"], layers, lay["schedule"]) is not None:
        return None
    out, start = [], 0
    for j, n in enumerate(counts):
        part = ["tok_embeddings"] if j == 0 else []
        part += [f"layers.{i}" for i in range(start, start + n)]
        out.append(part + (["norm", LINES[line].OUTPUT] if j == len(counts) - 1 else []))
        start += n
    return out


def files(plan_json: dict, line: str = DEFAULT) -> dict[str, str]:
    """The files the command line names, written beside the plan (0.2: torchtitan.toml for a
    split that only module names express)."""
    return LINES[line].files(module_parts(plan_json, line))


def env(plan_json: dict) -> dict[str, str | None]:
    """torchtitan needs nothing in the rank's environment beyond torchrun's."""
    return {}


def render(plan_json: dict, run_dir: Path, plan_dir: Path | None = None,
           line: str = DEFAULT) -> tuple[list[str], list[str]]:
    """torchtitan `line`'s words for this plan: (after trainer.command, after trainer.args)."""
    plan_dir = plan_dir or run_dir
    lay, cfg = plan_json["layout"], plan_json["config"]
    tr = cfg["training"]
    pp, dp, zero = lay["pp"], lay["dp"], lay["zero"]
    shard, repl = (1, dp) if zero == 0 else (lay["dp_shard"], lay["dp_replicate"])
    par = {"data_parallel_replicate_degree": repl, "data_parallel_shard_degree": shard,
           "tensor_parallel_degree": lay["tp"], "context_parallel_degree": lay["cp"],
           "pipeline_parallel_degree": pp, "expert_parallel_degree": lay["ep"]}
    if lay["ep"] > 1:
        par["expert_tensor_parallel_degree"] = lay["etp"]
    if zero >= 2:
        par["fsdp_reshard_after_forward"] = "never" if zero == 2 else "default"
    if pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULE_NAMES[lay["schedule"]]
        par["pipeline_parallel_microbatch_size"] = lay["micro_batch"]
        par.update(stage_settings(_counts(lay), pp, cfg["model"]["layers"], lay["schedule"]) or {})
    local = tr["global_batch"] // dp if pp > 1 else lay["micro_batch"]
    train = {"local_batch_size": local, "global_batch_size": tr["global_batch"], "seq_len": tr["seq_len"],
             "steps": tr["steps"], "max_norm": clip_norm(tr["max_norm"], cfg["stack"]["grad_clip"]),
             "mixed_precision_param": "float32" if tr["precision"] == Precision.fp32.value else "bfloat16"}
    return LINES[line].render(plan_json, run_dir, Path(plan_dir), par, train, module_parts(plan_json, line))


def framework_rank(coords: dict, plan_json: dict) -> int:
    """The RANK whose coordinates in torchtitan's mesh (MESH, row-major over RANK as
    init_device_mesh lays it out) are these plan coordinates (dp = replicate x shard)."""
    lay = plan_json["layout"]
    shard = 1 if lay["zero"] == 0 else lay["dp_shard"]
    repl = lay["dp"] // shard
    idx = {"pp": coords["pp"], "dp_replicate": coords["dp"] // shard, "dp_shard": coords["dp"] % shard,
           "cp": coords["cp"], "tp": coords["tp"]}
    size = {"pp": lay["pp"], "dp_replicate": repl, "dp_shard": shard, "cp": lay["cp"], "tp": lay["tp"]}
    r = 0
    for d in MESH:
        r = r * size[d] + idx[d]
    return r


def expert_groups(plan_json: dict, line: str = DEFAULT) -> list[list[int]]:
    """torchtitan's expert-parallel groups, in RANKs. 0.2 (pd.py _build_mesh_with_ep): dp_shard
    splits into mod_ep x in_ep and ep flattens in_ep, cp and (with etp=1) tp. 0.3 (pd.py
    build_mesh, the sparse mesh pp, dp_replicate, efsdp, ep): ep innermost over dp_shard x cp x tp."""
    import numpy as np

    lay = plan_json["layout"]
    tp, cp, ep, etp, shard = lay["tp"], lay["cp"], lay["ep"], lay["etp"], lay["dp_shard"]
    world = lay["pp"] * lay["dp"] * cp * tp
    if line != v0_2.LINE:
        return np.arange(world).reshape(-1, ep).tolist()
    inner = ep // cp if etp == tp else ep // (cp * tp)
    cube = np.arange(world).reshape(lay["pp"], lay["dp"] // shard, shard // inner, inner, cp, tp)
    axes = [3, 4] if etp == tp else [3, 4, 5]  # each group: ep ranks
    rest = [i for i in range(6) if i not in axes]
    return np.transpose(cube, rest + axes).reshape(-1, ep).tolist()


assert set(SCHEDULE_NAMES) <= set(SCHEDULES)

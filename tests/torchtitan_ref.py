"""Run inside a torchtitan release's subprocess (tests/frameworks.run): torchtitan's own code on
rendered command lines. Reads {"cases": [{"id", "argv", "world"}]} as JSON on stdin, prints
one JSON object per case: what its ConfigManager().parse_args read back, the layers of each
pipeline stage from its split functions and the pp rank holding each stage, and every group of
each dimension of the mesh ParallelDims(...).build_mesh() makes under torch's fake process
group (a CPU, no GPU), for all ranks of the world; one mesh per distinct layout. The rank's
GPU is an H100 for the checks torchtitan makes of it when it builds a registry config (float8
needs SM89)."""
import contextlib
import io
import json
import re
import sys
import traceback

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torch.utils._triton import has_triton_package  # noqa: E402

has_triton_package()  # cached False before torchtitan imports the triton stand-in: torch runs without triton here
import torch._inductor.runtime.triton_compat  # noqa: E402,F401  (so does its `import triton`, made before)
import torch._dynamo  # noqa: E402,F401
torch.cuda.is_available = lambda: True  # the rank's GPU, as torchtitan asks of it while configuring
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

import torchtitan  # noqa: E402
from importlib.metadata import version  # noqa: E402

RELEASE = version("torchtitan")
LINE = ".".join(RELEASE.split(".")[:2])
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
import torchtitan.distributed.pipeline_parallel as pp_mod  # noqa: E402
if LINE == "0.2":
    from torchtitan.protocols.train_spec import get_train_spec
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "ep")


def layers_of(part):
    return [int(m.split(".")[1]) for m in part if re.fullmatch(r"layers\.\d+", m)]


def float8(cfg):
    """Whether the model trains in float8: 0.2 names the converter; 0.3's registry entry swaps the
    model config's linears for Float8Linear (components/quantization/float8.py)."""
    if LINE == "0.2":
        return "float8" in cfg.model.converters
    from torchtitan.components.quantization.float8 import Float8Linear
    return Float8Linear is not None and any(True for _ in cfg.model_spec.model.traverse(Float8Linear.Config))


def parallel_dims(par):
    if LINE == "0.2":
        return ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                            etp=par.expert_tensor_parallel_degree, world_size=WORLD)
    return ParallelDims.from_config(par, WORLD)


@contextlib.contextmanager
def fake_world(rank, world):
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


SKELETONS = {}


def skeleton(name, flavor):
    """0.2's model (built once per flavor on the meta device) with each top-level child and each
    layer an nn.Identity, the names kept: pipeline_module_split deep-copies the whole model for
    every stage it builds, which for 126 layers is minutes; the stage placement is the same."""
    if (name, flavor) not in SKELETONS:
        spec = get_train_spec(name)
        with torch.device("meta"):
            model = spec.model_cls(spec.model_args[flavor])
        skel = torch.nn.Module()
        for child, mod in model.named_children():
            if isinstance(mod, torch.nn.ModuleDict):
                mod = torch.nn.ModuleDict({k: torch.nn.Identity() for k in mod})
            elif isinstance(mod, torch.nn.ModuleList):
                mod = torch.nn.ModuleList(torch.nn.Identity() for _ in mod)
            else:
                mod = torch.nn.Identity()
            setattr(skel, child, mod)
        SKELETONS[name, flavor] = skel, set(dict(model.named_modules()))
    return SKELETONS[name, flavor]


def split(cfg):
    par = cfg.parallelism
    if par.pipeline_parallel_degree == 1:
        return None, None
    pp = par.pipeline_parallel_degree
    if LINE == "0.2":
        n_layers = get_train_spec(cfg.model.name).model_args[cfg.model.flavor].n_layers
        parts = par.module_fqns_per_model_part
        if parts is None:  # pipeline_llm (0.2 has no separate function for the stage count): None = its default
            single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
            lps = par.pipeline_parallel_layers_per_stage
            first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
            stages = -(-(n_layers + first + last) // lps) if lps else pp * (1 if single else 2)
            parts = pp_mod.generate_llm_fqn_per_model_part(stages, n_layers, first, last)
        # 0.2's stage placement lives inside pipeline_module_split: run it for each pp rank on a pp
        # mesh of its own (what it takes of the mesh is its pp rank, size and group)
        model, names = skeleton(cfg.model.name, cfg.model.flavor)
        unknown = sorted({m for p in parts for m in p} - names)
        if unknown:
            raise ValueError(f"module_fqns_per_model_part names modules the model does not have: {unknown}")
        owner = {}
        for rank in range(pp):
            with fake_world(rank, pp):
                mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
                stages, _ = pp_mod.pipeline_module_split(model, mesh, par.pipeline_parallel_schedule,
                                                         torch.device("meta"), parts)
            owner.update({st.stage_index: rank for st in stages})
    else:
        stages, n_layers, first, last = pp_mod._get_pipeline_metadata(parallel_dims(par), par,
                                                                      cfg.model_spec.model)
        parts = par.module_fqns_per_model_part or pp_mod._generate_llm_fqn_per_model_part(stages, n_layers, first, last)
        owner = {s: rank for rank in range(pp)
                 for s in pp_mod._get_pp_rank_to_stage_indices_mapping(rank, pp, par.pipeline_parallel_schedule,
                                                                       len(parts))}
    return [layers_of(p) for p in parts], [owner[s] for s in range(len(parts))]


MESHES = {}


def groups(par):
    """Every group of each dimension of the mesh torchtitan's build_mesh makes, for all ranks at
    once: built once per layout (as RANK 0), each dimension's DeviceMesh holds the layout of all
    its groups; torch lays them out (remap_to_tensor, as its `mesh` property and its process group
    creation do) and keeps the row of the calling rank. That row is checked against `mesh`."""
    pd = parallel_dims(par)
    key = (WORLD, pd.pp, pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.ep, getattr(pd, "etp", 1),
           getattr(pd, "spmd_backend", None))
    if key in MESHES:
        return MESHES[key]
    out = {}
    with fake_world(0, WORLD):
        pd.build_mesh()
        get = (lambda n: pd.world_mesh[n]) if LINE == "0.2" else pd.get_mesh
        for n in DIMS:
            try:
                sub = get(n)
            except (KeyError, ValueError, RuntimeError):
                continue  # a dimension of degree 1 is not built
            every = sub._layout.remap_to_tensor(sub._rank_map).reshape(-1, sub.size())
            if sub.mesh.flatten().tolist() not in every.tolist():
                raise AssertionError(f"{n}: rank 0's group {sub.mesh.tolist()} is not among {every.tolist()[:4]}")
            out[n] = every.tolist()
    MESHES[key] = out
    return out


def cp_rotation(par) -> str:
    """The K/V rotation torch's context parallelism runs under this config: 0.2 hands
    context_parallel_rotate_method to torch's set_rotate_method (torchtitan/distributed/utils.py
    create_context_parallel_ctx); 0.3 sets none, so torch's default runs."""
    from torch.distributed.tensor.experimental import _attention as cp

    if LINE == "0.2":
        cp.set_rotate_method(par.context_parallel_rotate_method)
    return cp._cp_options.rotate_method.name


cases = json.load(sys.stdin)["cases"]
for case in cases:
    WORLD = case["world"]
    res = {"id": case["id"], "release": RELEASE}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = ConfigManager().parse_args(case["argv"])
        par, tr = cfg.parallelism, cfg.training
        res["read"] = {"dp_replicate": par.data_parallel_replicate_degree, "dp_shard": par.data_parallel_shard_degree,
                       "tp": par.tensor_parallel_degree, "cp": par.context_parallel_degree,
                       "pp": par.pipeline_parallel_degree, "ep": par.expert_parallel_degree,
                       "local_batch": tr.local_batch_size, "global_batch": tr.global_batch_size,
                       "seq_len": tr.seq_len, "steps": tr.steps, "max_norm": tr.max_norm,
                       "micro_batch": par.pipeline_parallel_microbatch_size,
                       "schedule": par.pipeline_parallel_schedule,
                       "dump_folder": cfg.job.dump_folder if LINE == "0.2" else cfg.dump_folder,
                       "seed": tr.seed if LINE == "0.2" else cfg.debug.seed,
                       "checkpoint": [cfg.checkpoint.enable, cfg.checkpoint.folder, cfg.checkpoint.interval],
                       "recompute": cfg.activation_checkpoint.mode if LINE == "0.2"
                       else type(cfg.activation_checkpoint).__qualname__,
                       "fp8": float8(cfg), "cp_rotation": cp_rotation(par),
                       "compile": sorted(cfg.compile.components) if cfg.compile.enable else [],
                       "async_tp": par.enable_async_tensor_parallel if LINE == "0.2"
                       else cfg.compile.enable_async_tensor_parallel}
        try:  # torchtitan splits its own model: where trainer.args name another (a debug model), it may refuse
            res["split"], res["stage_rank"] = split(cfg)
        except ValueError as e:
            res["split"], res["stage_rank"], res["split_error"] = None, None, str(e)[:500]
        res["groups"] = groups(par)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 (SystemExit from tyro too): report, go on with the next
        res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"[:2000] + traceback.format_exc()[-1500:]
    print(json.dumps(res), flush=True)

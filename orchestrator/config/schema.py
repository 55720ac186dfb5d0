"""Structured configs: the typed contract behind every Hydra config group.

Registered in Hydra's ConfigStore so a misspelled key or a value of the wrong
type fails at compose time with the key named. Key names are the README's and are
stable once landed. Pure Python: no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from orchestrator.config.launchers import LAUNCHER_SCHEMAS, LauncherName  # noqa: F401 (part of the schema)
from orchestrator.config.schedules import SCHEDULES


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class MLP(str, Enum):
    swiglu = "swiglu"  # three matrices (gate, up, down): Llama
    gelu = "gelu"  # two matrices: GPT / Megatron


class RouterScore(str, Enum):
    sigmoid = "sigmoid"  # DeepSeek-V3: gates are the chosen affinities, normalised to sum to 1
    softmax = "softmax"  # Mixtral, DeepSeek-V2: top-k of the softmax


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"  # caches linear-layer inputs in one byte (DeepSeek-V3)
    # Blackwell's block-scaled formats (plan/kernels.py LOW_PRECISION): FP8 with an E8M0 scale per
    # 32 elements (OCP MX; Transformer Engine's MXFP8 recipe), FP4 E2M1 with an E4M3 scale per 16
    # (NVIDIA's NVFP4 pretraining recipe, arXiv:2509.25149: fprop, dgrad and wgrad in FP4, the
    # wgrad inputs through a random Hadamard transform; training.bf16_layers stay in BF16).
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


class Backend(str, Enum):
    nccl = "nccl"
    gloo = "gloo"


class Metric(str, Enum):
    mfu = "mfu"  # model FLOPs only (PaLM, Llama 3)
    hfu = "hfu"  # hardware FLOPs: recomputation counted (Megatron 2021's "% of peak")


class FaultMode(str, Enum):
    step = "step"  # once fault.at_step steps have completed
    random = "random"  # a seeded random step
    during_save = "during_save"  # inside that step's checkpoint save


class FaultKind(str, Enum):
    kill_node = "kill_node"  # every process of fault.kill_node killed (a node lost)
    # global rank fault.rank exits with an error (a GPU fault, an OOM kill); its node stays up
    crash_rank = "crash_rank"
    # global rank fault.rank dies of a fatal signal of its own (SIGSEGV: a fault in native code, a
    # driver or library bug); its node stays up
    segfault_rank = "segfault_rank"
    hang_rank = "hang_rank"  # global rank fault.rank stops making progress (blocks) before a step
    # every rank of node fault.kill_node sleeps fault.slow_s more each step from fault.at_step on
    # (a throttled GPU, a bad link): a straggler (failover.straggler_*)
    slow_node = "slow_node"
    # global rank fault.rank's copy of the state is cut off from the other copies on the data path
    # from fault.at_step on (first attempt): its ranks stay alive in the cross-copy collective and
    # its leader's control connection stays up (a partition the control plane cannot see)
    cut_copy = "cut_copy"


# the kinds that strike one global rank (fault.rank) before a step, its node left up
RANK_KINDS = (FaultKind.crash_rank, FaultKind.segfault_rank, FaultKind.hang_rank)


class BatchPolicy(str, Enum):
    # the global batch stays exact over every surviving whole replica: its micro-batches split
    # unevenly when the replicas do not divide them (some take one more; training.uneven_batch)
    keep = "keep"
    even = "even"  # exact and evenly split: fewer micro-batches per micro-batch size, or fewer nodes
    adjust = "adjust"  # round it down to what the survivors can run evenly, and report the change


# Generated from the schedule registry: adding a schedule there adds it here.
Schedule = Enum("Schedule", {name: name for name in SCHEDULES}, type=str)


class KernelModel(str, Enum):
    constant = "constant"  # one hardware.kernel_efficiency for everything (the planner's first model)
    shape = "shape"  # per-GEMM roofline at the per-GPU shapes, memory-bound work, attention, overheads


@dataclass
class TierConfig:
    """A network tier above the node: GPUs per block and bandwidth per GPU."""

    name: str = MISSING
    size: int = MISSING  # GPUs in one block of this tier (rack 16, pod 3072, ...)
    gbps: Optional[float] = None  # GB/s per GPU crossing into this tier
    oversubscription: float = 1.0  # bandwidth = (gbps or inter_node_gbps) / this
    latency_us: float = 10.0


@dataclass
class HardwareConfig:
    name: str = MISSING
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0  # as marketed: an "80 GB" H100 has 80 GiB
    peak_tflops: float = MISSING  # dense bf16 per GPU
    intra_node_gbps: float = MISSING  # GB/s per GPU per direction (NVLink)
    inter_node_gbps: float = MISSING  # GB/s per GPU (400 Gb/s = 50 GB/s)
    hbm_gbps: float = 3350.0  # memory bandwidth per GPU: memory-bound kernels (non-flash attention)
    intra_node_latency_us: float = 3.0
    inter_node_latency_us: float = 10.0
    tiers: List[TierConfig] = field(default_factory=list)
    # cost.kernel_model=constant (the planner's first model): the one fraction of the roofline
    # every kernel reaches, MFU ~ useful fraction x kernel efficiency (fitted on calibration.csv).
    kernel_efficiency: float = 0.6
    # cost.kernel_model=shape: the fraction of peak that large bf16 GEMMs reach on this GPU
    # (the shape-aware kernel model's ceiling; fitted per GPU generation on published runs).
    gemm_efficiency: float = 0.75
    # Dense FP8 tensor-core peak per GPU; None = twice peak_tflops (Hopper, Blackwell).
    peak_fp8_tflops: Optional[float] = None
    # dense FP4 per GPU (Blackwell's block-scaled tensor cores; None: no FP4, and no MXFP8/NVFP4)
    peak_fp4_tflops: Optional[float] = None
    # Memory the framework cannot use: CUDA context, NCCL buffers, fragmentation.
    reserve_gb: float = 4.0
    # Failure model for the blast-radius report (Llama 3: 419 unexpected
    # interruptions in 54 days on 16,384 GPUs = 1.97e-5 per GPU-hour).
    failures_per_gpu_hour: float = 1.97e-5
    storage_gbps: float = 500.0  # aggregate checkpoint write bandwidth, GB/s
    # which kernel model this preset's efficiency was fitted for (cost.kernel_model overrides it)
    kernel_model: KernelModel = KernelModel.shape
    device: Device = Device.cuda  # the runtime's device type
    backend: Backend = Backend.nccl
    # Measured presets (orchestrate-calibrate --probe): host time per kernel/op on this device
    # (None: cost.launch_overhead_us), and the cores the processes of a hardware=cpu run share
    # (0: one per process; more processes than cores share their time).
    launch_overhead_us: Optional[float] = None
    host_cores: float = 0.0
    # Measured presets: host microseconds per collective call as the runtime issues it
    # (orchestrator/plan/overheads.py; 0 = not modelled, as on every GPU preset): a DTensor
    # redistribute (TP), one DTensor op above a plain one, a plain c10d call (CP, PP, the loss),
    # FSDP2's per-unit gathers of one micro-batch and its per-unit gradient reduce-scatter, one
    # K/V gather or gradient all-reduce as context parallelism's attention issues it (0: a plain
    # c10d call's), and per parameter tensor per step the optimizer (AdamW) and what it costs
    # more on a DTensor parameter (TP's and FSDP2's), and per micro-batch and model chunk what
    # torch's pipelining schedule and PipelineStage add to a stage's forward and backward.
    tp_call_us: float = 0.0
    dtensor_op_us: float = 0.0
    c10d_call_us: float = 0.0
    fsdp_gather_us: float = 0.0
    fsdp_reduce_us: float = 0.0
    cp_call_us: float = 0.0
    optimizer_us: float = 0.0
    dtensor_optimizer_us: float = 0.0
    pp_microbatch_us: float = 0.0
    # per FSDP2 unit and call, what each rank of the group beyond a pair adds to fsdp_gather_us and
    # fsdp_reduce_us (a ring's steps grow with the group; the probe times a group of 4 with --ranks 4+)
    fsdp_gather_step_us: float = 0.0
    fsdp_reduce_step_us: float = 0.0
    # FlashAttention-2's speed on this GPU relative to the fused attention kernels the fitted
    # cost.attention_efficiency describes (cuDNN / FlashAttention-3 on Hopper), for stacks that
    # run FA2 (stack.attention_kernel=flash2). 1 where FA2 is that kernel (Ampere).
    flash2_speed: float = 1.0
    # Board power (W): the datasheet's maximum (TDP) and the cap the site runs at, where a source
    # states one (None: at TDP). A GPU capped below its TDP clocks its tensor cores down, and its
    # GEMMs and attention slow with the clock (plan/kernels.clock_fraction).
    tdp_w: Optional[float] = None
    power_cap_w: Optional[float] = None


@dataclass
class ClusterConfig:
    nodes: int = 1  # the nodes the plan runs on
    spare_nodes: int = 0  # more nodes kept idle (warm) to replace a lost one without shrinking DP
    # The hosts and their network, to see the placement before submitting (plan/placement.py):
    # a SLURM topology.conf (tree: SwitchName=... Nodes=/Switches=...; block: BlockName=... Nodes=...)
    # and a SLURM hostlist (node[1-4,7]). A SLURM job reads its own allocation and topology.
    topology: Optional[str] = None
    nodelist: Optional[str] = None


class PipelineRules(str, Enum):
    torch = "torch"  # torch.distributed.pipelining's checks (Schedule1F1B raises below pp micro-batches)
    megatron = "megatron"  # Megatron-Core's (1F1B caps its warm-up and runs; interleaving needs m % pp == 0)


class PipelineAccounting(str, Enum):
    layers = "layers"  # only transformer layers fill the pipeline's virtual stages
    # The embedding and the loss each take one layer's place: the first and last virtual stage
    # build one transformer layer fewer (Megatron-Core --account-for-embedding-in-pipeline-split,
    # --account-for-loss-in-pipeline-split)
    embedding_loss = "embedding_loss"
    auto = "auto"  # embedding_loss where the layers alone do not split evenly and with them they do


class CPComm(str, Enum):
    all_gather = "all_gather"  # K/V all-gathered (Llama 3, torch CP's allgather rotation, this runtime)
    p2p = "p2p"  # ring attention: K/V blocks passed around the ring, hidden behind each block's attention
    # (Megatron-Core's default --cp-comm-type; torch CP's "alltoall" rotation, a shift to rank + 1)
    a2a = "a2a"  # DeepSpeed-Ulysses / Megatron a2a: sequence <-> head shards by all-to-all
    # What each trainer renders or refuses: frameworks/megatron.py, frameworks/torchtitan/, plan/capability.py


class ActivationLayout(str, Enum):
    sbh = "sbh"  # [sequence, batch, hidden] (Megatron-Core): sequence parallelism shards dim 0
    bsh = "bsh"  # [batch, sequence, hidden] (torch's TP, torchtitan, this runtime): it shards dim 1


class AttentionKernel(str, Enum):
    fused = "fused"  # cuDNN fused attention / FlashAttention-3 (Transformer Engine)
    flash2 = "flash2"  # FlashAttention-2 (torch SDPA's flash backend)


class CrossEntropy(str, Enum):
    """The loss kernels a stack runs over the logits (plan/kernels.LOSSES: their HBM traffic and memory)."""
    torch = "torch"  # F.cross_entropy on fp32 logits, eager (torchtitan without a compiled loss, this runtime)
    inductor = "inductor"  # the same, through torch.compile (torchtitan compiles the loss from 2025)
    megatron = "megatron"  # Megatron's vocab_parallel_cross_entropy (--cross-entropy-loss-fusion off, its default)
    megatron_fused = "megatron_fused"  # its fused regions (cross_entropy_loss_fusion, impl native)
    te = "te"  # Transformer Engine's Triton parallel_cross_entropy (cross_entropy_fusion_impl te)


class EPOverlap(str, Enum):
    # How the stack overlaps the expert all-to-all with compute besides the schedule's own
    # (DualPipe: schedule.overlaps_ep). combined_1f1b: Megatron-Core's --overlap-moe-expert-parallel-comm
    # (megatron/core/pipeline_parallel/combined_1f1b.py, models/common/model_chunk_schedule_plan.py): one
    # micro-batch's forward runs beside another's backward, layer by layer, each dispatch/combine on a
    # communication stream behind one module (attention side or experts) of the other micro-batch;
    # the first forward and last backward (the pipeline's warm-up and cool-down) run alone.
    # combined_1f1b_delay_wgrad: the same with --delay-wgrad-compute (Megatron-Bridge's moe_a2a_overlap
    # sets both): the weight gradients run after the module's input gradients, outside its event, so
    # the next all-to-all of that micro-batch need not wait for them.
    none = "none"
    combined_1f1b = "combined_1f1b"
    combined_1f1b_delay_wgrad = "combined_1f1b_delay_wgrad"


class DPWindow(str, Enum):
    step = "step"  # dp_overlap x the step's compute (this runtime's first model)
    microbatch = "microbatch"  # the last micro-batch's backward and the next step's first forward


class Selective(str, Enum):
    orchestrator = "orchestrator"  # norms, attention core and the SwiGLU product (this runtime's)
    attention_core = "attention_core"  # the attention core only (Megatron, Korthikanti et al. 2022)
    # torchtitan's op-level selective AC (activation_checkpoint.mode=selective, op: both releases):
    # the attention kernel and every odd-numbered matmul of a block are saved; every second matmul,
    # the memory-bound ops, the SP all-gathers and MoE's routed experts run again in backward.
    # The matmuls are counted as the release's models run them: 0.3's Llama 3 projects q, k and v
    # in one matmul (fuse_qkv), 0.2's in three (every_other_matmul_split_qkv).
    every_other_matmul = "every_other_matmul"
    every_other_matmul_split_qkv = "every_other_matmul_split_qkv"


@dataclass
class StackConfig:
    """The software stack a plan is for: what it shards, what it overlaps, what its
    "selective" recompute recomputes and whose pipeline rules apply. Presets in
    conf/stack/ cite their sources; `orchestrator` is this project's own runtime."""

    name: str = MISSING
    runtime: bool = False  # orchestrator's runtime trains it (launcher=local/slurm)
    zero: int = 3  # data-parallel sharding when layout.zero is unset: 0 DDP, 1 optimizer, 2 +grads, 3 +weights
    # FSDP under pipelining keeps each stage's weights gathered from the first micro-batch's
    # forward to the last one's backward (torch.distributed.pipelining with FSDP2; torchtitan's
    # default): ZeRO-3 then holds and moves what ZeRO-2 does, and is planned as ZeRO-2.
    pp_keeps_weights_gathered: bool = False
    # layout.etp unset: experts take the dense tensor-parallel degree (Megatron: etp defaults to
    # tp, megatron/training/arguments.py) or none (torchtitan: expert_tensor_parallel_degree=1).
    expert_tp_follows_tp: bool = True
    grad_bytes: float = 2.0  # per parameter in the gradient buffer (Megatron keeps fp32 main grads: 4)
    # The part of the step that hides data-parallel traffic (gradient reduce-scatter or
    # all-reduce, weight all-gather), as a fraction of the step's compute.
    dp_overlap: float = 2.0 / 3.0
    dp_first_gather_exposed: bool = True  # the step's first weight all-gather cannot hide (ZeRO-3/FSDP)
    tp_overlap: float = 0.0  # fraction of tensor-parallel communication hidden behind GEMMs
    ep_overlap: EPOverlap = EPOverlap.none  # the stack's expert all-to-all overlap (EPOverlap)
    # Share of the GPU's SMs the overlapped all-to-all kernels take from the computation while
    # they run (DeepSeek-V3: 20 of 132 SMs, Sec. 3.2.2); the hidden communication slows the
    # compute it hides behind by this share.
    ep_comm_sm_fraction: float = 0.0
    selective: Selective = Selective.orchestrator
    pipeline_rules: PipelineRules = PipelineRules.torch
    # What fills the pipeline's virtual stages (PipelineAccounting): transformer layers only, or the
    # embedding and the loss counted as one layer each (Megatron-Core's account-for options).
    pipeline_accounting: PipelineAccounting = PipelineAccounting.layers
    # When data-parallel traffic can hide. `step`: behind dp_overlap x the step's whole compute
    # (this runtime's first model). `microbatch`: gradients are final only in the last
    # micro-batch, so their reduction hides behind that micro-batch's backward (model chunk by
    # model chunk when interleaved) and the weight all-gather behind the next step's first
    # forward (Megatron-Core's --overlap-grad-reduce/--overlap-param-gather, FSDP with
    # gradient accumulation); dp_overlap then says how much of that window it uses.
    dp_window: DPWindow = DPWindow.step
    # Bytes per gradient element in the data-parallel reduction; None = grad_bytes
    # (Megatron-LM reduces bf16 runs' gradients in fp32; Llama 3 reduce-scatters in fp32).
    grad_reduce_bytes: Optional[float] = None
    # Parallel transformer block (attention and MLP side by side, GPT-J/PaLM/MegaScale): one
    # tensor-parallel collective per block and direction instead of two.
    parallel_block: bool = False
    # Data-parallel collectives per round: 0 = one per layer (FSDP's units); > 0 = one per gradient
    # bucket of max(this, 1M x dp) parameters (Megatron-Core's DDP: 40M; DeepSpeed: 5e8). ZeRO-3
    # gathers per layer whatever the buckets.
    dp_bucket_params: float = 0.0
    # ZeRO-3 weight all-gathers per layer and pass: one per FSDP unit (1: FSDP, FSDP2, Megatron's
    # FSDP), or one per submodule where the stack gathers each submodule's parameters as it runs
    # (DeepSpeed: partitioned_param_coordinator.fetch_sub_module, one coalesced all-gather per leaf
    # module: a GPT layer's QKV, output projection, two MLP linears and two LayerNorms = 6).
    # Each call pays the collective's latency (plan/cost.py _dp_latency_s).
    zero3_gathers_per_layer: float = 1.0
    # How context parallelism moves K/V (CPComm; plan/cost.py _cp_traffic)
    cp_comm: CPComm = CPComm.all_gather
    # Norms, activations, rotary embeddings and residual adds as fused kernels (Transformer
    # Engine / Apex, torch.compile): one read and one write per op. False: PyTorch eager, op by
    # op, each intermediate through HBM (plan/kernels.py EAGER).
    fused_elementwise: bool = True
    # The attention kernel the stack calls (AttentionKernel): `fused` (cuDNN / FlashAttention-3
    # through Transformer Engine, what cost.attention_efficiency is fitted on) or `flash2`
    # (torch's scaled_dot_product_attention flash backend: FlashAttention-2), at hardware.flash2_speed.
    attention_kernel: AttentionKernel = AttentionKernel.fused
    # Low-precision linear layers save their inputs for backward in FP8 (Transformer Engine: the copy
    # the forward cast; plan/inventory.FP8_ACT) or in bf16, cast again in backward (torchao's
    # Float8Linear, which torchtitan's float8 converts nn.Linear to: torchao/float8/float8_linear.py).
    fp8_saves_fp8: bool = True
    # The loss over the vocabulary (CrossEntropy): the kernels the stack runs on the last stage's
    # logits, priced as their HBM traffic and the memory they hold (plan/kernels.LOSSES, counted from each stack's
    # own code by tests/test_step_bytes.py). This runtime: torch's eager cross_entropy.
    cross_entropy: CrossEntropy = CrossEntropy.torch
    # Which activation dimension sequence parallelism shards (ActivationLayout). NCCL gathers and
    # scatters along dim 0, so torch's functional collectives gather or reduce-scatter a [b, s, h]
    # activation on its sequence dim with one copy of the whole activation each (all_gather_single:
    # _maybe_view_chunk_cat, none when the micro-batch is one sequence; reduce_scatter_single:
    # _chunk_or_narrow_cat; plan/kernels.sp_copies); Megatron's [s, b, h] needs none. Not with async
    # TP (stack.tp_overlap > 0 on a torch stack): its fused all-gather-matmul moves the shard, not
    # the whole activation.
    activation_layout: ActivationLayout = ActivationLayout.sbh
    # Per-parameter sharding (FSDP2): each weight all-gather lands in one flat buffer and is copied
    # out into the parameters (foreach_all_gather_copy_out: split_with_sizes_copy), and each
    # gradient reduce-scatter first copies the unsharded gradients into its input, cast to the
    # reduce dtype (foreach_reduce_scatter_copy_in: chunk_cat), both on the compute stream
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); the fp32 shards are the
    # optimizer's parameters. False: flat buffers the collectives and the weights share, and a
    # bf16 copy of the weights refreshed from the optimizer's fp32 master once a step (Megatron's
    # DDP and distributed optimizer). plan/kernels.step_features.
    gather_copy_out: bool = False
    # The optimizer step clips the gradients' global norm at training.max_norm (Megatron: --clip-grad,
    # torchtitan: training.max_norm, this runtime: train/parallel.clip_grad_norm): a read of every
    # gradient and a scale (plan/kernels.CLIP_BYTES), once a step, when training.max_norm > 0
    # (Config.clips). False: a stack that never clips, whatever training.max_norm says.
    grad_clip: bool = True


@dataclass
class FabricConfig:
    """The network above the GPUs: how big an NVLink domain is and the tiers above it
    (rack, pod, oversubscribed cluster). Separate from the GPU, so
    `hardware=h100_sxm fabric=fat_tree` describes a run as its authors ran it."""

    name: str = MISSING
    nvlink_domain: Optional[int] = None  # GPUs on one NVLink domain; None = one node (NVL72: 72)
    tiers: List[TierConfig] = field(default_factory=list)  # above the NVLink domain; none = one flat network


@dataclass
class MoEConfig:
    experts: int = 0  # 0 = dense model
    experts_per_token: int = 0
    expert_ffn_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-V3: 3)
    # Tokens on the busiest expert rank over the mean (0 = perfectly balanced, as force-balanced
    # benchmarks run): expert GEMMs and the all-to-all run at the busiest rank's pace.
    load_imbalance: float = 0.1
    # Node-limited routing (DeepSeek-V3: each token to experts on at most 4 nodes, sent once
    # per node over the network and forwarded over NVLink); 0 = no limit.
    max_nodes_per_token: int = 0
    # The runtime's router (DeepSeek-V3, Sec. 2.1.2): affinity function, gate scale, the
    # auxiliary-loss-free bias update speed (gamma; 0 = off) and the sequence-wise balance
    # loss weight (alpha; 0 = off; DeepSeek-V3 uses 1e-4).
    score: RouterScore = RouterScore.sigmoid
    route_scale: float = 1.0
    bias_update_speed: float = 0.001
    aux_loss_coef: float = 0.0


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank 0 = ordinary GQA."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass
class ModelConfig:
    name: str = MISSING
    layers: int = MISSING
    hidden: int = MISSING
    ffn_hidden: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    vocab: int = MISSING
    head_dim: Optional[int] = None  # default hidden // heads
    mlp: MLP = MLP.swiglu
    tied_embeddings: bool = False
    dropout: bool = False  # GPT/Megatron-style dropout masks (1 byte per element)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # fsspec URL; None = <run dir>/checkpoints
    every: int = 0  # save every N steps and at the end; 0 = no checkpoints
    keep: int = 2  # complete checkpoints kept (older ones are deleted)
    async_save: bool = False  # write in the background; marked complete before the next save
    # A snapshot of every rank's state in host memory, its own node's and a buddy node's (train/keeper.py),
    # every N steps: a restart reads it back when it is newer than the newest checkpoint. None: the
    # plan's interval (plan/goodput.snapshot_every); 0: none.
    snapshot_every: Optional[int] = None


@dataclass
class ResumeConfig:
    allow_batch_change: bool = False  # shorthand for allow=[training.global_batch, training.seq_len]
    # keys that may differ from the checkpoint's on purpose (e.g. [training.seed, model.rope_theta])
    allow: List[str] = field(default_factory=list)


@dataclass
class TrainingConfig:
    seq_len: int = 4096
    global_batch: int = 512  # sequences per optimizer step
    micro_batch: int = 1
    steps: int = 100
    recompute: Recompute = Recompute.none
    # With recompute=full: recompute only this many layers of each model chunk, the rest keep
    # their activations (Megatron's --recompute-method block --recompute-num-layers N);
    # None = every layer.
    recompute_layers: Optional[int] = None
    # Multi-token prediction modules trained beside the model (DeepSeek-V3: 1): each one more
    # block, a projection and the shared output head on the last stage; their FLOPs are hardware
    # FLOPs, not model FLOPs (the published MFU counts the main model).
    mtp_depth: int = 0
    precision: Precision = Precision.bf16
    # under fp8 / mxfp8 / nvfp4: transformer layers whose linear layers stay in BF16 (the NVFP4
    # recipe keeps a few of the last ones in BF16 for stability); costed as that share of every stage
    bf16_layers: int = 0
    optimizer_bytes: float = 12.0  # per parameter: fp32 master + Adam m, v (DeepSeek-V3: 8, bf16 moments)
    seed: int = 0
    lr: float = 3e-4
    log_every: int = 1
    data: Optional[str] = None  # fsspec URL of a flat token file (uint16); None = synthetic stream
    adam_eps: float = 1e-8
    # The optimizer step first scales the gradients so their global L2 norm (the whole model's, over
    # every parallel dimension) is at most this (torchtitan: training.max_norm, Megatron-LM:
    # --clip-grad; both default 1.0); 0 = no clipping. Priced where the stack clips (stack.grad_clip).
    max_norm: float = 1.0
    flash_attention: bool = True
    # The global batch's micro-batches may split unevenly over the data-parallel replicas (the
    # first global_batch/micro_batch % dp replicas take one more; gradients weighted so the update
    # is the full batch's). Failover re-plans set it to keep every surviving replica; dense models.
    uneven_batch: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)


@dataclass
class LayoutConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: Any = "auto"  # an int, or "auto" = what is left of the world
    ep: int = 1  # expert parallel: its own grid over the same ranks (Megatron-Core's expert RankGenerator)
    etp: Optional[int] = None  # expert tensor parallel; None = tp (Megatron's default)
    vp: int = 1  # virtual pipeline stages per rank (interleaved schedules)
    sequence_parallel: bool = True
    zero: Optional[int] = None  # 0 DDP, 1 optimizer, 2 +gradients, 3 +parameters (FSDP); None = the stack's
    # ranks that shard one copy of the model state (FSDP/ZeRO); None = all of dp. Smaller keeps
    # dp / dp_shard whole copies (HSDP), so a lost replica can be dropped in place.
    dp_shard: Optional[int] = None
    # innermost-first list ([tp, cp, pp, dp]), a Megatron string ("tp-cp-ep-dp-pp"), or auto
    order: Any = "auto"
    # explicit per-stage layer counts for uneven splits, e.g. Llama 3 405B [7, 8, ..., 8, 7]
    stage_layers: Optional[List[int]] = None
    allow_cross_node_tp: bool = False
    search: bool = False  # layout=auto selects the search


@dataclass
class ScheduleConfig:
    name: Schedule = Schedule["1f1b"]
    microbatches: Optional[int] = None  # default global_batch / (dp * micro_batch)


@dataclass
class CostConfig:
    # Count attention's own FLOPs (causal, as a flash kernel computes them). The
    # seed's worked example counts only 6 * N * tokens: set false to reproduce it.
    attention_flops: bool = True
    # None: the hardware preset's (hardware.kernel_model: what its efficiency was fitted for)
    kernel_model: Optional[KernelModel] = None
    # Shape-aware kernel model (orchestrator/plan/kernels.py). Fitted on published runs with
    # benchmarks/calibration.py (least squares over every row; leave-one-source-out reported).
    elementwise: float = 0.836  # weight of the memory-bound work (norms, activations, casts, softmax)
    attention_efficiency: float = 0.504  # fraction of the bf16 peak flash attention's forward reaches
    fp8_gemm_efficiency: float = 1.0  # FP8 GEMMs' ceiling relative to the bf16 one (power, scaling)
    launch_overhead_us: float = 15.115  # host time per kernel launch the GPU waits for (small kernels)


@dataclass
class PublishedConfig:
    source: str = ""
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None  # fraction, 0.43 not 43
    metric: Metric = Metric.mfu
    step_s: Optional[float] = None


@dataclass
class FaultConfig:
    """Fault injection for tests and demos (fault.kind): a node kind strikes node fault.kill_node
    (or several at the same step: fault.kill_node=[1,2], two nodes at once), a rank kind global
    rank fault.rank."""

    kill_node: Any = None  # the node(s) a node kind strikes (kill_node, slow_node): an index or a list
    at_step: Optional[int] = None  # once this many steps have completed
    mode: FaultMode = FaultMode.step
    seed: int = 0
    rejoin_at_step: Optional[int] = None  # the killed node comes back once this many steps completed
    kind: FaultKind = FaultKind.kill_node
    rank: Optional[int] = None  # the global rank a rank kind (crash_rank, segfault_rank, hang_rank) strikes
    slow_s: float = 1.0  # slow_node: the extra seconds each of its ranks spends in every step

    def nodes(self) -> list:
        """The nodes fault.kill_node names (one or a list; empty when unset)."""
        k = self.kill_node
        return [] if k is None else [k] if isinstance(k, (int, str)) else list(k)


@dataclass
class FailoverConfig:
    enabled: bool = True
    # A total cap on restarts (None: no cap); the rate below is what fits a large job.
    max_failovers: Optional[int] = None
    # Restarts allowed in any hour of the run; None = derived from the plan's job MTBF
    # (4 x the expected failures per hour, at least 3).
    max_failovers_per_hour: Optional[float] = None
    # Stop when this many attempts in a row fail without completing a step beyond the last failure's.
    no_progress_attempts: int = 3
    # A hang: no rank made progress for this long (None: 10 x the plan's predicted step + save,
    # at least 30 s; launch/progress.py). The rank furthest behind is named and its node lost.
    progress_deadline_s: Optional[float] = None
    min_dp: int = 1
    batch_policy: BatchPolicy = BatchPolicy.keep
    # With several copies of the state (layout.dp_shard < dp) the survivors go on in place;
    # false: always re-plan and restart from the last checkpoint.
    in_place: bool = True
    # The failover timeouts, ordered: settle window < quorum < collective, hang deadline <
    # collective (plan/timeouts.py; None: derived from the plan's step and save; plan.md prints them).
    timeout_s: Optional[float] = None  # a collective across copies gives up on a silent peer after this
    quorum_s: Optional[float] = None  # after the first copy's report, how long the coordinator waits for the rest
    # The supervisor's lease (launch/lease.py): on SLURM with more than one node a standby supervisor
    # on the last node takes over, in the same allocation, when the active one has not renewed the
    # lease in the run directory for this long (its node lost). Renewed lease_s / LEASE_RENEWALS
    # often. None: max(LEASE_FLOOR_S, LEASE_RENEWALS x launcher.poll_s) (plan/timeouts.py): a few
    # renewals may miss (a shared file system's hiccup) before anyone takes over.
    lease_s: Optional[float] = None
    # The job's store runs this many shards (TCPStore servers; None: one per 4,096 ranks,
    # rundir.store_shards): each group's keys live on one shard, so a generation's rebuild of its
    # cross-copy groups runs on all of them at once (train/replicas.py, plan/goodput.rebuild_s).
    store_shards: Optional[int] = None
    # A cut the control plane cannot see: every rank in a step's cross-copy collective this long
    # with no copy committing it -> the coordinator aborts the generation and re-forms it without
    # the copy the others cannot reach (launch/control.py). None: 10 x the plan's predicted
    # cross-copy collective, at least 10 s, at most half of timeout_s (plan/timeouts.py).
    collective_bound_s: Optional[float] = None
    # A straggler: a copy whose own work in a step (before it waits on the other copies) took more
    # than straggler_margin x the copies' median for straggler_steps steps in a row (steps its copy
    # spent saving a checkpoint are not counted). It is named in status.json, TensorBoard and
    # failover.json (launch/stragglers.py); with evict_stragglers and a warm spare waiting, its
    # node is treated as lost (reason "straggler") and the spare takes its place. Without a spare
    # it is kept and the run says so: evicting it would shrink the job.
    straggler_margin: float = 1.3
    straggler_steps: int = 5
    evict_stragglers: bool = False


@dataclass
class SearchConfig:
    top: int = 5


class TrainerName(str, Enum):
    orchestrator = "orchestrator"  # this project's runtime (python -m orchestrator.train.worker)
    torchtitan = "torchtitan"  # torchtitan's train.py, its CLI overrides rendered from the plan
    megatron = "megatron"  # Megatron-LM's pretrain_gpt.py, its arguments rendered from the plan
    command = "command"  # any torchrun-compatible program (torchrun's environment + ORCH_PLAN)


@dataclass
class TrainerConfig:
    """What each rank runs (orchestrator/frameworks/trainers.py, orchestrator/launch/trainers.py).
    For torchtitan and megatron `command` is the entry point and the arguments rendered from
    the plan are appended to it, then `args`; for `command` it is the whole program."""

    name: TrainerName = TrainerName.orchestrator
    command: Optional[str] = None  # shell words, split with shlex and run without a shell
    args: List[str] = field(default_factory=list)  # appended after the rendered arguments
    stack: Optional[str] = None  # the stack it plans on unless stack= is given (torchtitan, megatron_core)
    config_file: Optional[str] = None  # torchtitan 0.2: --job.config_file (the model and data it trains)
    version: Optional[str] = None  # torchtitan: the release line to render for (0.2, 0.3); unset: the installed one


def preset(group: str) -> Any:
    """The default option of a config group (conf/config.yaml's defaults list), read from its
    YAML preset: `Config()`'s defaults are the presets the command line composes, so
    make_plan(Config(...)) plans what `orchestrate` plans; the dataclasses' own field defaults
    only fill the keys a preset leaves out, as in Hydra."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(_preset_node(group))


@lru_cache(maxsize=None)
def _preset_node(group: str):
    from omegaconf import OmegaConf

    from orchestrator.config.paths import CONF_DIR

    option = default_options()[group]
    if group == "launcher":
        return OmegaConf.structured(LAUNCHER_SCHEMAS[LauncherName(option)])
    node = OmegaConf.structured(GROUPS[group])
    path = CONF_DIR / group / f"{option}.yaml"
    if group == "schedule":  # registered options (config/compose.register), no YAML
        return OmegaConf.merge(node, {"name": option})
    return OmegaConf.merge(node, OmegaConf.load(path))


@lru_cache(maxsize=None)
def default_options() -> dict[str, str]:
    """group -> its default option, from conf/config.yaml's defaults list (the one place they are chosen)."""
    from omegaconf import OmegaConf

    from orchestrator.config.paths import CONF_DIR

    entries = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml").defaults)
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if k in GROUPS and v is not None}


def _default(group: str):
    return field(default_factory=lambda: preset(group))


@dataclass
class Config:
    hardware: HardwareConfig = _default("hardware")
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = _default("model")
    training: TrainingConfig = field(default_factory=TrainingConfig)
    layout: LayoutConfig = _default("layout")
    schedule: ScheduleConfig = _default("schedule")
    launcher: Any = _default("launcher")  # one of LAUNCHER_SCHEMAS, chosen by the `launcher` group
    stack: StackConfig = _default("stack")
    fabric: FabricConfig = _default("fabric")
    cost: CostConfig = field(default_factory=CostConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    published: Optional[PublishedConfig] = None
    recipe_name: Optional[str] = None
    figures: bool = True

    def clip_norm(self) -> float:
        """The global gradient norm the optimizer step clips at (0: no clip), `clip_norm`."""
        return clip_norm(self.training.max_norm, self.stack.grad_clip)


def clip_norm(max_norm: float, grad_clip: bool) -> float:
    """The one definition of whether and where a run clips its gradients' global norm: at
    training.max_norm where the stack clips (stack.grad_clip), else 0 (no clip). The planner prices
    the clip when it is > 0 (plan/kernels.step_features), the runtime clips at it (train/trainer.py)
    and the renderers pass it on (Megatron-LM --clip-grad, torchtitan training.max_norm)."""
    return float(max_norm) if grad_clip and max_norm > 0 else 0.0


# The config groups: the option chosen on the command line is merged onto the bare class (Hydra's
# schema for the group, config/compose.hydra_schema); Config() takes each group's default preset.
GROUPS: Dict[str, type] = {"hardware": HardwareConfig, "model": ModelConfig, "layout": LayoutConfig,
                           "schedule": ScheduleConfig, "launcher": Any, "stack": StackConfig, "fabric": FabricConfig}

"""The data model that every other module imports: model spec, training config, hardware, estimate.

Everything here is a frozen, validated pydantic model, so a value that reaches the core has already
been checked, and a result can be serialised to JSON with `.model_dump(mode="json")`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    computed_field,
    field_validator,
    model_validator,
)

from planner import caches, env
from planner.identity_cache import per_object

# "fp8": FP8 training (issue 35): the transformer layers' Linear GEMMs in FP8 (torchao float8 or Transformer
# Engine, by fp8_recipe); everything else as amp-bf16 (fp32 master weights, bf16 activations and non-linear
# ops). planner.pipeline.resolve computes it as amp-bf16 plus the FP8 rules of planner.ir.fp8.
Precision = Literal["fp32", "amp-fp16", "amp-bf16", "fp16", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "amp-fp16", "amp-bf16", "fp16", "bf16", "fp8")
# FP8 scaling recipes: torchao float8's (tensorwise, rowwise: dynamic scaling) and Transformer Engine's
# (delayed: DelayedScaling, current: Float8CurrentScaling, mxfp8: MXFP8BlockScaling, Blackwell only).
Fp8Recipe = Literal["tensorwise", "rowwise", "delayed", "current", "mxfp8"]
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "delayed", "current", "mxfp8")
OptimizerName = Literal["adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw-8bit"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw-8bit")
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
OPTIMIZER_IMPLS: tuple[str, ...] = ("foreach", "fused", "for-loop")
Parallelism = Literal["auto", "single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
PARALLELISMS: tuple[str, ...] = ("single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
# "auto": the kernel Hugging Face transformers picks by default for the model type in the stack's versions
# (planner.memory.stack.default_attention); `estimate` resolves it, so an Estimate's config never says "auto".
Attention = Literal["auto", "eager", "sdpa", "flash"]
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
Family = Literal["bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "mixtral", "qwen2_moe", "qwen3_moe",
                 "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"]
FAMILIES: tuple[str, ...] = ("bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "mixtral", "qwen2_moe",
                             "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3")
Head = Literal["base", "sequence-classification", "masked-lm", "causal-lm"]
# Where kernels run. "cuda" is what the planner predicts; "cpu" exists so tests can compare the same
# formulas with what CPU kernels save (dropout masks, SDPA fallback, autocast op lists differ).
Backend = Literal["cuda", "cpu"]
# The OOM verdict with its uncertainty band: "fits" only when even the high end of the whole-device peak is
# under the GPU's memory, "oom" only when even the low end is over it, "tight" in between.
Verdict = Literal["fits", "tight", "oom"]
# How the frozen base of a LoRA run is stored (planner.adapters): "auto" = the dtype --precision implies
# (fp32 for fp32 and AMP, 16-bit for pure 16-bit), as transformers loads it; "nf4" = QLoRA (bitsandbytes 4-bit
# NormalFloat with double quantization, computing in the precision's 16-bit dtype).
BaseDtype = Literal["auto", "fp32", "bf16", "fp16", "nf4"]
# The training loop whose tensor lifetimes the step assumes (planner.memory.loops says when each one frees the
# model's outputs and the gradients, with the source lines).
Loop = Literal["plain", "hf-trainer", "accelerate", "lightning", "loss-only"]
# How the model reaches the GPU: built in its training dtype ("direct"), or built in fp32 and cast
# (`model.to(bf16)`), which leaves the fp32 build's segments in the caching allocator's pool.
Load = Literal["direct", "cast"]
# Whose training loop and parallel wrappers run the step (planner.parallel.frameworks): how --precision is
# applied (autocast, FSDP's mixed-precision policy, Megatron's or DeepSpeed's 16-bit engine with fp32 master
# weights) and each framework's defaults (prefetch, reshard after forward, buckets).
Framework = Literal["pytorch", "torchtitan", "megatron", "deepspeed", "accelerate", "lightning", "nemo-automodel"]
FRAMEWORKS: tuple[str, ...] = ("pytorch", "torchtitan", "megatron", "deepspeed", "accelerate", "lightning",
                               "nemo-automodel")
BASE_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "nf4")
# Pipeline schedules (planner.parallel.dims): Megatron-Core's and torch.distributed.pipelining's names.
PipelineSchedule = Literal["1f1b", "interleaved-1f1b", "gpipe", "zero-bubble"]
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")
# Activation recomputation: "full" is --checkpointing (every layer keeps only its input); "selective" recomputes
# the modules named in recompute_modules (Megatron's --recompute-modules names) or torchtitan's per-op policy.
Recompute = Literal["none", "full", "selective"]
RECOMPUTES: tuple[str, ...] = ("none", "full", "selective")

# Instances in one training job. SageMaker's per-account quotas (Service Quotas, "ml.<type> for training job
# usage") are adjustable and the API itself sets no maximum (botocore sagemaker-2017-07-24 TrainingInstanceCount:
# min 0 only). ASSUMPTION: 2,048 instances (16,384 GPUs at 8 per instance) bounds any job this tool plans, above
# the largest published SageMaker runs (hundreds of p4d/p5 instances). Override: $PLANNER_MAX_INSTANCES.
MAX_INSTANCES = int(env.limit("PLANNER_MAX_INSTANCES"))

# Samples per GPU in one micro-batch. ASSUMPTION: 2^31 - 1 (PyTorch's int32 kernel-indexing limit on one dimension);
# any micro-batch near it is out of memory on every GPU, so above it the answer is this error, not an OOM verdict
# computed with 100-digit byte counts.
MAX_BATCH = 2**31 - 1

# Micro-steps per optimizer step. ASSUMPTION: 65,536; it keeps micro-batch × accumulation × GPUs below 2^63
# (2^31 · 2^16 · 2^14 = 2^61), the int64 columns of a search's trials table. One limit for every command
# (estimate, explain, probe and search). Override: $PLANNER_MAX_GRAD_ACCUM.
MAX_GRAD_ACCUM = int(env.limit("PLANNER_MAX_GRAD_ACCUM"))

# Samples per epoch: integers that a float64 holds exactly (2^53, IEEE 754), since the trials table and
# `--json` carry them as numbers. One limit for estimate's and search's --dataset-size.
MAX_DATASET_SIZE = 2**53

BYTES_PER_DTYPE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1,
                                    "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ----------------------------------------------------------------------------------------- model


class TransformerSpec(Frozen):
    """One Hugging Face transformer (encoder or decoder), with the fields the formulas need.

    `hf_config` keeps the original config.json so that tests and the probe job build exactly this model.
    """

    kind: Literal["transformer"] = "transformer"
    family: Family
    architecture: str  # transformers class name, e.g. "BertForSequenceClassification"
    head: Head
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    intermediate_size: PositiveInt
    max_positions: PositiveInt  # longest usable sequence (RoBERTa: table size - padding_idx - 1)
    position_table: int = 0  # rows of a learned position table; 0 for rotary embeddings
    type_vocab_size: int = 0  # rows of the token-type table; 0 when the model has none
    hidden_act: str = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    embedding_dropout: float = 0.1
    classifier_dropout: float | None = None
    pooler: bool = False
    num_labels: int = 2
    tie_word_embeddings: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    # The attention heads' width when config.json sets `head_dim` apart from hidden/heads (Qwen3-MoE: 128 with
    # hidden 2048 and 32 heads); 0: hidden_size // num_heads.
    head_size: int = 0
    # Mixture-of-experts layers (issue 35; planner/families/forms/moe_gated.py): routed experts, how many each
    # token picks (top-k), each expert's SwiGLU width, the shared expert's width (Qwen2-MoE; 0 none), whether
    # top-k weights are renormalised, and the layers whose MLP is a dense one (Qwen's mlp_only_layers /
    # decoder_sparse_step). All 0 / empty for a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V3's multi-head latent attention (MLA): q through a rank-q_lora_rank bottleneck (0: one q_proj),
    # keys and values from a rank-kv_lora_rank latent, qk_rope_head_dim of each head rotated; head_size is the
    # query/key head (nope + rope), v_head_dim the value head. All 0 for other attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The forward returns its KV cache during training: transformers' `use_cache` as the training forward sees
    # it (model option `use_cache=true`; planner/memory/kv_cache.py). Off by default, as the probe job builds
    # its models and as transformers' gradient_checkpointing_enable sets it in training.
    use_cache: bool = False
    # NeMo AutoModel's benchmark gate (model option `fake_balanced_gate=true`, its recipes' `model.backend.
    # fake_balanced_gate: true`): the MoE router is nemo_automodel/components/moe/layers.py FakeBalancedGate, which
    # has no parameters and spreads tokens round-robin over the experts without autograd: no router weight (nor
    # its gradient and optimizer states), no router GEMM, nothing saved for backward. MoE models only.
    fake_balanced_gate: bool = False
    hf_config: dict[str, Any] = Field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (some layers route each token to `experts_per_token` of its experts)."""
        return self.num_experts > 0

    def sparse_layer(self, index: int) -> bool:
        """Layer `index` runs the routed experts (not a dense MLP)."""
        return self.moe and index not in self.dense_layers


class DenseSpec(Frozen):
    """nn.Linear applied to one feature vector per sample."""

    kind: Literal["dense"] = "dense"
    in_features: PositiveInt
    out_features: PositiveInt
    bias: bool = True


class BatchNormSpec(Frozen):
    """nn.BatchNorm1d over one feature vector per sample."""

    kind: Literal["batchnorm"] = "batchnorm"
    num_features: PositiveInt


Layer = Annotated[TransformerSpec | DenseSpec | BatchNormSpec, Field(discriminator="kind")]


class Component(Frozen):
    """A named part of a model (e.g. TabAE, TextBertBase, merge) reported separately."""

    name: str
    layers: tuple[Layer, ...]


class InputSpec(Frozen):
    """What one training sample feeds the model, to size the batch with PyTorch's real dtypes."""

    input_ids: bool = True  # int64
    attention_mask: bool = True  # int64 in HF tokenizers' output
    token_type_ids: bool = False  # int64
    tabular_features: int = 0  # float32
    labels: Literal["class", "tokens", "none"] = "class"  # int64 per sample, or per token for LMs


_TRANSFORMERS: dict[int, tuple] = caches.table("planner.spec._TRANSFORMERS", scope="model",
    key="ModelSpec.components identity (per_object): its transformer layers")  # ModelSpec.components -> its transformer layers (`per_object`)


def _transformer_layers(components: tuple[Component, ...]) -> tuple[TransformerSpec, ...]:
    return tuple(layer for c in components for layer in c.layers if isinstance(layer, TransformerSpec))


class ModelSpec(Frozen):
    name: str
    components: tuple[Component, ...]
    inputs: InputSpec = InputSpec()
    loss: Literal["cross-entropy", "multimodal", "none"] = "cross-entropy"
    description: str = ""
    # How the model was made, so the probe job can rebuild it (catalog name + options, or a config).
    source: dict[str, Any] = Field(default_factory=dict)

    @property
    def transformers(self) -> tuple[TransformerSpec, ...]:
        """The transformer layers, in order: found once per `components` (an estimate reads them several times,
        and a search makes thousands)."""
        return per_object(_TRANSFORMERS, self.components, _transformer_layers)

    @property
    def max_positions(self) -> int | None:
        limits = [t.max_positions for t in self.transformers]
        return min(limits) if limits else None


# --------------------------------------------------------------------------------------- training


class DeepSpeedSettings(Frozen):
    """What of a DeepSpeed config (ds_config JSON) changes memory and speed. Defaults are DeepSpeed's own
    (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig: reduce_bucket_size and allgather_bucket_size
    pp_int(5e8), stage3_prefetch_bucket_size pp_int(5e7), stage3_param_persistence_threshold pp_int(1e5),
    stage3_max_live_parameters pp_int(1e9), contiguous_gradients True, overlap_comm None: True at stage 3,
    else False). Element counts, not bytes."""

    stage: int | None = Field(None, ge=0, le=3)  # zero_optimization.stage (None: not given)
    dtype: Literal["bf16", "fp16", "fp32"] | None = None  # bf16.enabled / fp16.enabled (None: not given)
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    prefetch_bucket_size: int = Field(50_000_000, ge=0)
    param_persistence_threshold: int = Field(100_000, ge=0)
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    # ZeRO-3's fp32 partition is stepped in sub-groups of at most this many elements (zero_optimization.
    # sub_group_size, DeepSpeed's default pp_int(1e9))
    sub_group_size: int = Field(1_000_000_000, ge=1)
    # the ds_config has no "optimizer" block: the training script's own optimizer (the Hugging Face Trainer's
    # or Accelerate's) is passed to deepspeed.initialize and steps DeepSpeed's flat fp32 partitions
    # (deepspeed/runtime/engine.py _configure_optimizer: a client optimizer is wrapped, DeepSpeed's FusedAdam
    # is built only from the config's "optimizer" block); False: DeepSpeed's own (the planner's default)
    client_optimizer: bool = False
    source: str = ""  # the file it was read from


class TrainConfig(Frozen):
    """One training configuration, per GPU. `batch_size` is the micro-batch on one GPU."""

    batch_size: int = Field(ge=1, le=MAX_BATCH)  # see MAX_BATCH
    seq_len: int = Field(ge=1, le=MAX_BATCH)  # tokens per sample: the same int32 bound as a micro-batch
    precision: Precision = "fp32"
    optimizer: OptimizerName = "adamw"
    optimizer_impl: OptimizerImpl = "foreach"
    parallelism: Parallelism = "auto"
    checkpointing: bool = False
    attention: Attention = "auto"
    grad_accum: int = Field(1, ge=1, le=MAX_GRAD_ACCUM)  # see MAX_GRAD_ACCUM
    instances: int = Field(1, ge=1, le=MAX_INSTANCES)  # SageMaker InstanceCount; see MAX_INSTANCES
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = Field(25.0, gt=0, allow_inf_nan=False)
    # fp32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32 = True; NGC containers and
    # HF's --tf32 turn it on; PyTorch's own default is off). Only Ampere and later have TF32.
    tf32: bool = False
    # LoRA adapters on a frozen base (planner.adapters): lora_r None trains every parameter (no adapters).
    # Defaults follow peft's LoraConfig: lora_alpha = 8, dropout 0, targets () = peft's default per model type.
    lora_r: int | None = Field(None, ge=1)
    # alpha scales the adapters' output by alpha / r: only a finite positive number means anything (NaN was
    # printed as alpha=nan, and broke --json)
    lora_alpha: float | None = Field(None, gt=0, allow_inf_nan=False)
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False)
    base_dtype: BaseDtype = "auto"
    loop: Loop = "plain"
    load: Load = "direct"
    # Whose layouts and defaults apply (planner.parallel.frameworks); "pytorch": a plain loop with autocast.
    framework: Framework = "pytorch"
    # DeepSpeed's settings from the job's ds_config (--ds-config FILE); None: DeepSpeed's defaults.
    deepspeed: DeepSpeedSettings | None = None
    # Model parallelism (issue 34; planner.parallel.dims checks how the degrees combine): tensor (tp) with
    # sequence parallelism (sp; None: on when tp > 1, as Megatron-Core recipes run it), context (cp), pipeline
    # (pp stages, vp virtual stages per rank, pp_schedule; None: 1f1b, or interleaved-1f1b when vp > 1), and the
    # data-parallel rest: dp_replicas replica groups for HSDP (None: one), Megatron's distributed optimizer.
    tp: int = Field(1, ge=1, le=MAX_INSTANCES * 8)
    sp: bool | None = None
    cp: int = Field(1, ge=1, le=MAX_INSTANCES * 8)
    pp: int = Field(1, ge=1, le=MAX_INSTANCES * 8)
    vp: int = Field(1, ge=1, le=1024)
    pp_schedule: PipelineSchedule | None = None
    # Megatron's uneven first / last pipeline stage (--decoder-first/last-pipeline-num-layers; issue 35,
    # planner.parallel.layer_split): the layers the first / last rank holds; None: the framework's own split.
    first_stage_layers: int | None = Field(None, ge=0, le=100_000)
    last_stage_layers: int | None = Field(None, ge=0, le=100_000)
    # Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding / the loss counted as a layer
    account_for_embedding: bool = False
    account_for_loss: bool = False
    # Megatron's --pipeline-model-parallel-layout, e.g. "Et*3|(tt|)*29|L" (planner.parallel.layer_split)
    pp_layout: str | None = Field(None, min_length=1, max_length=2000)
    dp_replicas: int | None = Field(None, ge=1, le=MAX_INSTANCES * 8)
    distributed_optimizer: bool = False
    # Megatron-Core DDP's grad_reduce_in_fp32 (DistributedDataParallelConfig): the main-gradient buffer (and its
    # reduce-scatter / all-reduce) in fp32 (True) or in the parameters' 16-bit dtype (False). None: the
    # framework's default (fp32 under Megatron-LM's and Megatron-Bridge's bf16 defaults). Megatron only.
    grad_reduce_in_fp32: bool | None = None
    # FSDP's reshard after forward (FSDP2 `fully_shard(reshard_after_forward=...)`, torchtitan's
    # reshard_after_forward_policy always / never, NeMo AutoModel's `parallelizer.reshard_after_forward`, FSDP1
    # FULL_SHARD (True) vs SHARD_GRAD_OP (False)). None: the framework's default
    # (planner.parallel.frameworks.Framework.reshard_after_forward). FSDP strategies only.
    reshard_after_forward: bool | None = None
    # None: what --checkpointing says (full when on, none when off)
    recompute: Recompute | None = None
    recompute_modules: tuple[str, ...] = ()
    # Mixture-of-experts (issue 35): expert parallel (ep) and expert-tensor parallel (etp) degrees, and the
    # hottest rank's share of routed tokens over the mean (1.0: balanced).
    ep: int = Field(1, ge=1, le=MAX_INSTANCES * 8)
    etp: int = Field(1, ge=1, le=MAX_INSTANCES * 8)
    moe_imbalance: float = Field(1.0, ge=1.0, le=1024.0, allow_inf_nan=False)
    # FP8 (issue 35; planner.ir.fp8): the scaling recipe (None: the framework's default, tensorwise for
    # torchao / torchtitan, delayed for Transformer Engine under Megatron) and FSDP2's FP8 all-gather of
    # weights (torchao enable_fsdp_float8_all_gather). Read only when precision is "fp8".
    fp8_recipe: Fp8Recipe | None = None
    fp8_param_gather: bool = False
    # torch.compile (issue 35; planner.ir.transforms.compile_ops): Inductor's fused pointwise kernels and the
    # min-cut partitioner's saved tensors.
    compile: bool = False

    @field_validator("recompute_modules", mode="before")
    @classmethod
    def _modules_list(cls, value: Any) -> Any:
        """`core_attn,mlp` (a flag's or a sweep file's text) as a tuple of names."""
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_recompute(cls, data: Any) -> Any:
        """--checkpointing and --recompute said once: `recompute` "full" IS checkpointing (it sets it) and "none"
        is its absence, so both are stored as `checkpointing` and `recompute` keeps only "selective" (None
        otherwise). A config that says both ways (checkpointing with recompute none or selective) is refused.
        Read `recompute_mode` for the one answer."""
        if not isinstance(data, dict) or data.get("recompute") is None:
            return data
        mode, ckpt = data["recompute"], bool(data.get("checkpointing", False))
        if ckpt and mode != "full":
            raise ValueError(f"recompute {mode!r} contradicts checkpointing (= recompute full); give one of them")
        data = dict(data)
        if mode in ("full", "none"):
            data["recompute"] = None
            data["checkpointing"] = mode == "full"
        return data

    @property
    def recompute_mode(self) -> str:
        """none, full or selective: what is recomputed in backward (full = --checkpointing)."""
        return self.recompute or ("full" if self.checkpointing else "none")

    @property
    def lora(self) -> bool:
        """Adapters on a frozen base (LoRA, or QLoRA with base_dtype nf4)."""
        return self.lora_r is not None


# --------------------------------------------------------------------------------------- hardware


class GPU(Frozen):
    """Facts about one GPU model; every figure carries its source in `sources`."""

    name: str  # e.g. "NVIDIA V100-SXM2-16GB"
    family: str  # e.g. "V100": the key for runtime constants and calibration
    memory_bytes: int
    compute_capability: tuple[int, int]
    peak_tflops: dict[str, float]  # per precision: fp32, tf32, fp16, bf16 (dense tensor-core peak)
    memory_bandwidth_gbs: float
    bf16: bool
    flash_attention: bool  # FlashAttention-2 kernels need sm80+
    sources: tuple[str, ...] = ()
    # What the driver reports as total (nvidia-smi "Total", typical figure); memory_bytes is the nominal size.
    reported_memory_bytes: int | None = None
    # Added for the roofline (planner.perf.roofline); None where unknown (the wave rule is then skipped).
    sm_count: int | None = None  # streaming multiprocessors
    boost_clock_mhz: float | None = None
    l2_mib: float | None = None
    nvlink_gbs: float = 0.0  # total NVLink bandwidth per GPU, both directions (0: none)
    pcie_gbs: float | None = None  # host link, both directions
    # Runtime defaults of this GPU as data (gpus.json "runtime"); None: the module-wide default applies.
    cuda_context_mib: int | None = None  # lazy-loading CUDA context of a training process
    nccl_channels: int | None = None  # channels NCCL typically opens for a ring all-reduce
    runtime_source: str = ""
    # Figures the datasheet does not publish that an estimate still needs: "ASSUMPTION ..." lines naming
    # the value used (gpus.json "assumed"), repeated in every estimate on this GPU.
    assumptions: tuple[str, ...] = ()


class Instance(Frozen):
    name: str
    gpu: GPU
    gpus: PositiveInt
    vcpus: int | None  # None: not published for this size (instances.json says why)
    memory_gib: float | None  # host memory; None: not published
    interconnect: str  # e.g. "NVLink 300 GB/s", "PCIe Gen3"
    allreduce_bandwidth_gbs: float  # achievable bus bandwidth of a ring all-reduce inside the instance
    network_gbps: float  # between instances
    price_per_hour: float | None = None  # on-demand USD, region in `price_region`
    price_region: str = "us-east-1"
    price_date: str = ""
    price_source: str = ""
    cpu_model: str | None = None
    cpu_ghz: float | None = None  # the CPU's sourced (boost) clock, GHz: scales host dispatch (planner.perf.host)
    # "ASSUMPTION ..." lines for the figures instances.json does not source but the model needs ("assumed").
    assumptions: tuple[str, ...] = ()


class SoftwareStack(Frozen):
    """The software a training job runs: what decides the CUDA context, workspaces, the default attention
    kernel and the allocator's behaviour (issue 8). Versions are "X.Y" strings (planner/data/stacks.json)."""

    torch: str  # e.g. "2.8"
    cuda: str  # e.g. "12.9"
    transformers: str  # e.g. "4.46"
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF, e.g. "expandable_segments:True"
    given: bool = False  # the user named at least the torch version (else: the DLC default)
    source: str = ""  # where each version came from

    @property
    def expandable_segments(self) -> bool:
        from planner.alloc_conf import parse_alloc_conf

        return str(parse_alloc_conf(self.alloc_conf, self.torch).get("expandable_segments", "")).lower() == "true"

    @property
    def max_split_size(self) -> int | None:
        """max_split_size_mb in bytes (None: unlimited, the default). CUDAAllocatorConfig parses the value in
        MiB and keeps `val * 1024 * 1024`."""
        from planner.alloc_conf import parse_alloc_conf

        mb = parse_alloc_conf(self.alloc_conf, self.torch).get("max_split_size_mb")
        return None if mb is None else int(float(mb) * 1024 * 1024)


class BandTerm(Frozen):
    """One term of the whole-device peak with its uncertainty: low <= point <= high (bytes)."""

    name: str  # "cuda_context", "workspaces", "nccl", "reserved_pool", "tensors"
    point: int
    low: int
    high: int
    basis: str = ""  # why this width (stack given or defaulted, calibrated or not, allocator model or flat)


class RuntimeConstants(Frozen):
    """Memory outside PyTorch's tensors, per GPU family. Documented defaults, overridable, calibratable."""

    cuda_context_bytes: int  # driver + CUDA runtime + kernels loaded lazily, outside the caching allocator
    cublas_workspace_bytes: int  # allocated through the caching allocator, once per stream
    nccl_bytes_per_peer: int  # NCCL channel buffers, outside the allocator, only when world size > 1
    fragmentation: float  # reserved / allocated at the peak, minus one
    source: str = ""


# --------------------------------------------------------------------------------------- estimate


class MemoryBytes(Frozen):
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int  # bytes saved for backward by one micro-batch's forward (what stays under checkpointing)
    batch: int
    buffers: int  # temporaries at the peak: DDP buckets, optimizer temporaries, cuBLAS workspace, AMP casts
    peak_allocated: int  # what torch.cuda.max_memory_allocated would read
    peak_reserved: int  # what torch.cuda.max_memory_reserved would read
    cuda_context: int
    nccl: int
    peak_device: int  # what the whole GPU would show (nvidia-smi / mem_get_info)


class PhasePeak(Frozen):
    phase: Literal["load", "forward", "backward", "optimizer"]
    allocated: int
    detail: dict[str, int]


class Throughput(Frozen):
    """Predicted speed of one configuration; `breakdown_s` splits one optimizer step's time."""

    step_time_s: float  # one optimizer step (grad_accum micro-steps) on one instance
    samples_per_s: float  # per instance... summed over all instances in `instances_total`
    tokens_per_s: float
    mfu: float  # model FLOPs (no recompute) / (peak * time)
    global_batch_size: int
    breakdown_s: dict[str, float] = Field(default_factory=dict)
    gpus: int = 1  # GPUs of the whole job (world size) the rates are over

    @model_validator(mode="before")
    @classmethod
    def _derived_keys_in(cls, data: Any) -> Any:
        """A dumped record read back: its derived `tokens_per_s_per_gpu` is recomputed, not an input."""
        if isinstance(data, dict) and "tokens_per_s_per_gpu" in data:
            data = {k: v for k, v in data.items() if k != "tokens_per_s_per_gpu"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Job-wide tokens/s over the job's GPUs (issue 34: what Megatron and NeMo tables report)."""
        return self.tokens_per_s / max(self.gpus, 1)


class Cost(Frozen):
    price_per_hour: float  # for all instances of the job
    spot: bool = False
    usd_per_million_samples: float
    dataset_size: int | None = None
    hours_per_epoch: float | None = None
    usd_per_epoch: float | None = None
    price_source: str = ""
    # The whole job (a training recipe's `epochs` passes over `dataset_size` samples); with epochs=1 these
    # equal the per-epoch figures. Epochs may be fractional (a budget of steps rather than whole passes).
    epochs: float | None = None
    hours_per_job: float | None = None
    usd_per_job: float | None = None
    # Where and when the instance price is from (issue 22); stale: older than 180 days or before a known
    # price change (planner.prices.is_stale); None when the user gave the price.
    price_region: str = ""
    price_date: str = ""
    price_stale: bool | None = None


class AllocatorReplay(Frozen):
    """What replaying the step's tensors through the CUDA caching allocator model says
    (`planner.memory.allocator`): why reserved exceeds allocated."""

    peak_allocated: int  # allocated blocks at the peak (block sizes: rounded, unsplit remainders included)
    peak_reserved: int  # segments held at the peak (torch.cuda.max_memory_reserved)
    segments: int  # segments held when the reserved peak was reached
    peak_allocation: str  # the tensor whose new segment set the reserved peak
    peak_allocation_bytes: int  # its size
    peak_segment_bytes: int  # the segment (or expandable pages) it made the allocator reserve
    oom_retry: bool  # the allocator had to free its cached segments and retry (empty_cache path)
    oom_after_retry: bool  # even after that retry a cudaMalloc would exceed the GPU's memory
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    events: int = 0  # allocations + frees replayed


class RunSummary(Frozen):
    """A training run of batches of varying length through the allocator model, step after step
    (`planner.run`): what the device holds at the run's peak, not one step's."""

    lengths: str  # the --lengths source as given
    padding: str  # longest | bucketed | max (a file's batches); "given" for uniform padded lengths
    seed: int
    steps: int  # micro-steps simulated
    steps_converged: bool  # the reserved peak stopped moving (set in the first half of the steps)
    peak_allocated_bytes: int  # the longest step's allocated peak (exact tensors, as memory_bytes.peak_allocated)
    peak_reserved_bytes: int  # max_memory_reserved over the run
    peak_device_bytes: int  # CUDA context + NCCL + peak_reserved_bytes
    peak_step: int  # 1-based step whose new segment set the reserved peak (0: none)
    peak_step_length: int  # its padded length
    peak_allocation: str  # the tensor whose new segment set the reserved peak
    fixed_peak_reserved_bytes: int  # the one step at --seq-len (memory_bytes.peak_reserved)
    growth_bytes: int  # peak_reserved_bytes - fixed_peak_reserved_bytes
    growth_ratio: float  # peak_reserved_bytes / fixed_peak_reserved_bytes - 1
    longest: int  # the longest padded length in the run
    mean_length: float  # mean padded length
    padded_tokens: int  # per GPU over the run
    real_tokens: int | None = None  # per GPU over the run (None: uniform lengths give padded lengths only)
    padding_waste: float | None = None  # 1 - real / padded tokens
    truncated_samples: int = 0  # samples of the length file longer than --seq-len (truncated)
    oom_retry: bool = False  # the run made the allocator free its cache and retry (capacity reached)
    oom_after_retry: bool = False  # and still over: the run raises torch.OutOfMemoryError
    expandable_segments: bool = False
    events: int = 0  # allocations + frees replayed
    mean_step_time_s: float | None = None  # optimizer step, each micro-step at its own length
    real_tokens_per_s: float | None = None  # job-wide, real tokens only


class ParallelStage(Frozen):
    """One pipeline stage as its worst rank holds it (issue 34; planner.memory.stages): the layers it holds,
    each model state per rank, the activations of the micro-batches in flight, and its whole-device peak."""

    stage: int  # 0-based pipeline rank
    layers: tuple[int, ...]  # transformer layers held (every virtual chunk's)
    blocks: tuple[str, ...]  # the model's blocks held, in forward order (embeddings first stage, head last)
    parameters: int  # parameter elements per rank (after tensor parallelism, before data-parallel sharding)
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # saved for backward, all micro-batches in flight
    in_flight_micro_batches: float  # micro-batches whose activations the stage holds at its peak
    peak_allocated_bytes: int
    peak_device_bytes: int
    peak_device_low_bytes: int
    peak_device_high_bytes: int
    verdict: Verdict
    replayed: bool  # the allocator replay ran on this stage (else its reserved pool scaled from the worst's)
    # FSDP2 under pipeline parallelism: the stage's unsharded parameters and gradients held across the step's
    # micro-batches (planner.pipeline.step._unsharded_stage), besides the sharded states above
    unsharded_bytes: int = 0


class ParallelLayout(Frozen):
    """How the world is split (planner.parallel.dims.ParallelDims) and every pipeline stage's memory; the
    estimate's own memory_bytes and verdict are those of `worst_stage`."""

    world: int
    dp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    vp: int
    sp: bool
    schedule: str  # none without pipeline parallelism
    micro_batches: int  # per optimizer step, per pipeline (grad_accum)
    worst_stage: int
    stages: tuple[ParallelStage, ...] = ()


class Estimate(Frozen):
    model: str
    instance: str
    gpu: str
    config: TrainConfig  # resolved: parallelism is never "auto" here
    world_size: int
    parameters: dict[str, int]  # one entry per component, plus "total" (and "active" for a mixture of experts)
    memory_bytes: MemoryBytes
    phases: tuple[PhasePeak, ...]
    peak_phase: str
    gpu_memory_bytes: int
    usable_memory_bytes: int
    fits: bool  # a sure fit: the high end of the band is under the GPU's memory (verdict == "fits")
    headroom_bytes: int
    verdict: Verdict = "fits"
    peak_device_low_bytes: int = 0  # low end of the whole-device peak band
    peak_device_high_bytes: int = 0  # high end of the whole-device peak band
    runtime: RuntimeConstants
    allocator: AllocatorReplay | None = None  # the allocator replay behind peak_reserved (None: flat fragmentation given)
    stack: SoftwareStack | None = None  # the software stack the runtime terms were computed for
    band: tuple[BandTerm, ...] = ()  # the terms of peak_device_low/high_bytes (planner.memory.band)
    throughput: Throughput | None = None
    cost: Cost | None = None
    notes: tuple[str, ...] = ()
    run: RunSummary | None = None  # --lengths: the run of varying lengths; the verdict then follows its peak
    # tensor/context/pipeline parallelism (issue 34): the layout and each stage's memory; None for plain data
    # parallelism, and then absent from the JSON (every key of a plain estimate stays as it was)
    parallel: ParallelLayout | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"parallel"} if self.parallel is None else None)

"""The parallel layout of one job as one record: how the world of GPUs is split into data, tensor, context,
pipeline and expert groups, checked once.

Like torchtitan's `ParallelDims` (torchtitan/distributed/parallel_dims.py: `_validate` asserts that
dp_replicate · dp_shard · cp · tp · pp equals the world size) and Megatron-Core's `parallel_state`
(initialize_model_parallel: world = tp · pp · cp · dp; the expert layout ep · etp · pp divides the world,
the expert data-parallel group being the rest). Everything downstream (memory per rank, speed, the search's
factorizations, the probe's DeviceMesh) reads this record instead of the raw flags, so a combination that
cannot exist fails here, once, with the rule it breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.spec import ModelSpec, TrainConfig


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each dimension over `world` GPUs. dp = dp_replicate · dp_shard is the data-parallel size;
    ep · etp splits the experts of an MoE layer (their own data-parallel group is edp)."""

    world: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    vp: int
    sp: bool
    schedule: str  # "none" without pipeline parallelism
    ep: int = 1
    etp: int = 1
    # layers in each of the pp · vp model chunks, in chunk order (planner.parallel.layer_split); () where the
    # model's layers are unknown (a traced model), read as an even split
    chunks: tuple[int, ...] = ()

    def rank_layers(self, layers: int) -> tuple[float, ...]:
        """Transformer layers each pipeline rank holds (an even split of `layers` without `chunks`)."""
        if not self.chunks:
            return (layers / self.pp,) * self.pp
        from planner.parallel.layer_split import rank_layers

        return rank_layers(self.chunks, self.pp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """GPUs that hold one replica of the model between them (tp · cp · pp)."""
        return self.tp * self.cp * self.pp

    @property
    def edp(self) -> int:
        """The experts' data-parallel degree: world / (ep · etp · pp) (Megatron-Core parallel_state,
        expert_data_parallel_size)."""
        return self.world // (self.ep * self.etp * self.pp)

    @property
    def plain(self) -> bool:
        """Data parallelism only: what the planner modelled before issue 34."""
        return self.model_parallel == 1 and self.ep == 1 and self.etp == 1

    def micro_batches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches each pipeline runs per optimizer step: the global batch over data-parallel replicas
        and the micro-batch (Megatron's num_microbatches = global / (micro · dp))."""
        per_replica, rest = divmod(global_batch, micro_batch * self.dp)
        if rest or per_replica < 1:
            raise PlannerError("--global-batch-size", global_batch,
                               f"a multiple of micro-batch × data-parallel size ({micro_batch} × {self.dp})")
        return per_replica


def build(cfg: TrainConfig, world: int, *, layers: int | None = None, heads: int | None = None,
          kv_heads: int | None = None, seq_len: int | None = None, experts: int | None = None,
          top_k: int | None = None, ffn: int | None = None) -> ParallelDims:
    """The layout `cfg` asks for over `world` GPUs, or a PlannerError naming the first rule it breaks.
    Model facts left None are not checked (a traced model without a layer count, say)."""
    tp, cp, pp, vp, ep, etp = cfg.tp, cfg.cp, cfg.pp, cfg.vp, cfg.ep, cfg.etp
    mp = tp * cp * pp
    if world % mp:
        raise PlannerError("--tp/--cp/--pp", f"{tp}×{cp}×{pp}",
                           f"a product that divides the {world} GPUs of the job (tp × cp × pp × dp = GPUs)")
    dp = world // mp
    replicas = cfg.dp_replicas or 1
    if dp % replicas:
        raise PlannerError("--dp-replicas", replicas, f"a divisor of the data-parallel size {dp}")
    if cfg.dp_replicas is not None and cfg.parallelism != "hsdp":
        raise PlannerError("--dp-replicas", replicas, "only with --parallelism hsdp")
    if vp > 1 and pp == 1:
        raise PlannerError("--vp", vp, "only with --pp above 1 (virtual stages split a pipeline stage)")
    schedule = cfg.pp_schedule or ("interleaved-1f1b" if vp > 1 else "1f1b")
    if pp == 1:
        if cfg.pp_schedule is not None:
            raise PlannerError("--pp-schedule", cfg.pp_schedule, "only with --pp above 1")
        schedule = "none"
    elif vp > 1 and schedule not in ("interleaved-1f1b", "zero-bubble"):
        raise PlannerError("--pp-schedule", schedule, "interleaved-1f1b or zero-bubble with --vp above 1")
    elif vp == 1 and schedule == "interleaved-1f1b":
        raise PlannerError("--pp-schedule", schedule, "needs --vp above 1 (virtual stages to interleave)")
    sp = cfg.sp if cfg.sp is not None else tp > 1
    if sp and tp == 1 and cfg.sp:
        raise PlannerError("--sp", True, "only with --tp above 1 (it shards what tensor parallelism replicates)")
    if heads is not None and heads % tp:
        raise PlannerError("--tp", tp, f"a divisor of the model's {heads} attention heads")
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        raise PlannerError("--tp", tp, f"a divisor or a multiple of the model's {kv_heads} key/value heads")
    if ffn is not None and ffn % tp:
        raise PlannerError("--tp", tp, f"a divisor of the model's intermediate (MLP) size {ffn}")
    chunks: tuple[int, ...] = ()
    from planner.parallel.layer_split import SPLIT_FIELDS, chunk_layers, given_split, split_kwargs

    uneven = {f: getattr(cfg, f) for f in SPLIT_FIELDS}
    given = given_split(uneven)
    if given and pp == 1:
        field, value = next(iter(given.items()))
        raise PlannerError(SPLIT_FIELDS[field][1], value, "only with --pp above 1")
    if layers is not None and pp > 1:
        from planner.parallel.frameworks import get as framework

        chunks = chunk_layers(framework(cfg.framework).pipeline_split, layers, pp, vp, **split_kwargs(uneven))
    elif layers is not None and pp * vp > layers:
        raise PlannerError("--pp", pp, f"at most {layers} stages × virtual stages: the model has {layers} layers")
    if seq_len is not None:
        split = tp * cp * 2 if cp > 1 else (tp if sp else 1)
        if seq_len % split:
            why = "tp × cp × 2 (load-balanced context parallelism)" if cp > 1 else "tp (sequence parallelism)"
            raise PlannerError("--seq-len", seq_len, f"a multiple of {split} = {why}")
    if experts is None and (ep > 1 or etp > 1):
        raise PlannerError("--ep" if ep > 1 else "--etp", ep if ep > 1 else etp,
                           "1 for a model without experts (mixture-of-experts layers)")
    if experts is not None:
        if experts % ep:
            raise PlannerError("--ep", ep, f"a divisor of the model's {experts} experts")
        if top_k is not None and top_k > experts:
            raise PlannerError("num_experts_per_tok", top_k, f"at most the {experts} experts")
    if world % (ep * etp * pp):
        raise PlannerError("--ep/--etp", f"{ep}×{etp}",
                           f"a product that, times --pp {pp}, divides the {world} GPUs of the job")
    if schedule == "interleaved-1f1b" and cfg.grad_accum % pp:
        # megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving: "number of
        # microbatches is not divisible by pipeline-model-parallel-size when using interleaved schedule"
        raise PlannerError("--grad-accum", cfg.grad_accum, f"a multiple of --pp {pp}: the interleaved schedule runs "
                           "micro-batches in groups of the pipeline size (micro-batches per step)")
    if cfg.recompute_modules and cfg.recompute_mode != "selective":
        raise PlannerError("--recompute-modules", ",".join(cfg.recompute_modules), "only with --recompute selective")
    return ParallelDims(world=world, dp_replicate=replicas, dp_shard=dp // replicas, tp=tp, cp=cp, pp=pp, vp=vp,
                        sp=sp, schedule=schedule, ep=ep, etp=etp, chunks=chunks)


# The SDPA kernels torch's context parallelism shards (torch/distributed/tensor/experimental/_context_parallel/
# _attention.py, the dispatch table of _scaled_dot_product_ring_{flash,efficient,cudnn}_attention and their
# backwards, torch 2.7+): SDPA's flash, memory-efficient and cuDNN backends. Eager attention (matmul, softmax,
# matmul) and the flash-attn package's kernels (transformers' flash_attention_2, not an ATen op) have none.
# Megatron-Core runs context parallelism in Transformer Engine's attention (transformer_engine/pytorch/attention
# attn_forward_func_with_cp), whatever the planner calls the kernel, so only eager is refused there.
CONTEXT_PARALLEL_ATTENTION = ("sdpa",)


def check_attention(dims: ParallelDims, attention: str, framework: str) -> None:
    """Context parallelism needs an attention kernel that has it (`attention` resolved, never "auto")."""
    if dims.cp == 1:
        return
    from planner.parallel.frameworks import get

    allowed = ("sdpa", "flash") if get(framework).engine == "megatron" else CONTEXT_PARALLEL_ATTENTION
    if attention not in allowed:
        raise PlannerError("--attention", attention,
                           f"{' or '.join(allowed)} with --cp {dims.cp} (context parallelism shards SDPA's "
                           "flash, efficient and cuDNN kernels; eager attention has none)")


def for_model(spec: ModelSpec | None, cfg: TrainConfig, world: int) -> ParallelDims:
    """`build` with what `spec` says: for one transformer its layers, heads, key/value heads, MLP width and
    the sequence; for a mixture-of-experts model its experts and top-k. A traced model (None) or several
    transformers: the degrees alone. The one place a model's facts reach the layout's rules (the pipeline's
    resolve and the speed model's own callers both ask it)."""
    moe = [t for t in spec.transformers if t.moe] if spec is not None else []
    experts = {"experts": moe[0].num_experts, "top_k": moe[0].experts_per_token} if moe else {}
    if spec is None or len(spec.transformers) != 1:
        return build(cfg, world, **experts)
    t = spec.transformers[0]
    return build(cfg, world, layers=t.num_layers, heads=t.num_heads, kv_heads=t.num_kv_heads,
                 seq_len=cfg.seq_len, ffn=t.intermediate_size, **experts)

"""How a framework lays model states out on one GPU: the bytes per parameter of each state, what a sharded
unit costs while it runs, which precision the activations are computed in, and the buffers it adds.

The framework record (planner.parallel.frameworks) says how `--precision` is applied; this module turns that
into bytes. Four layouts:

- autocast (a plain loop; Accelerate and Lightning outside FSDP; torchtitan outside FSDP): fp32 parameters
  and gradients, 16-bit casts made by autocast (planner.memory.activations: cached for leaves until the
  forward ends). Under FSDP2 + autocast the unsharded parameters are leaves, so the cache keeps a 16-bit copy
  of every unit the forward has run. This is the planner's historical rule, unchanged.
- FSDP mixed-precision policy (torchtitan, Accelerate under FSDP): fp32 sharded parameters; a unit is
  all-gathered in 16 bits only while it computes, the next one prefetched (`units_in_flight`); the model
  computes in 16 bits (no autocast, so no weight cache); a unit's 16-bit gradients are copied into a
  `reduce_dtype` buffer for the reduce-scatter; sharded gradients in fp32.
- Megatron: 16-bit parameters, fp32 main gradients in a buffer that lives for the run, fp32 master weights
  beside Adam's states: 2 + 4 + 12 = 18 B per parameter, 6 + 12/DP with the distributed optimizer. With
  Megatron-Core DDP's `grad_reduce_in_fp32` off (TrainConfig.grad_reduce_in_fp32 False) the buffer is 16-bit
  (2 B) and the optimizer steps an fp32 copy of its shard (4 B / DP under the distributed optimizer).
- DeepSpeed: 16-bit parameters and gradients, fp32 master partition (2 + 2 + 12 = 16 B per parameter, divided
  by the ZeRO stage), reduce buckets of `reduce_bucket_size` elements, ZeRO-3's prefetch of
  `stage3_prefetch_bucket_size` elements beside the sub-module computing.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.memory import model_states
from planner.parallel import frameworks
from planner.parallel import get as strategy_of
from planner.spec import DeepSpeedSettings, TrainConfig

_SIXTEEN = {"amp-bf16": "bf16", "bf16": "bf16", "amp-fp16": "fp16", "fp16": "fp16", "fp8": "bf16"}


@dataclass(frozen=True)
class StateLayout:
    """Bytes per parameter of each model state under one framework, strategy and precision."""

    framework: str
    kind: str  # "autocast", "policy", "policy-fp32", "megatron", "deepspeed"
    param_bytes: int  # resident, per parameter (divided by the sharding share)
    grad_bytes: int  # resident, per trainable parameter
    gather_bytes: int  # per parameter of an all-gathered unit (0: the historical rule, fp32 minus the shard)
    unsharded_grad_bytes: int  # per parameter of a unit's gradients before the reduce-scatter
    reduce_copy_bytes: int  # a reduce_dtype copy of a unit's gradients for the reduce-scatter (0: none)
    master_bytes: int  # fp32 master weights the optimizer holds, per trainable parameter (sharded as states)
    state_param_bytes: int  # the dtype the optimizer's states follow
    step_grad_bytes: int  # an fp32 copy of the gradient partition made for the step (DeepSpeed), per param
    activation_precision: str  # --precision the activations are computed under
    autocast_cache: bool  # autocast's weight cache keeps 16-bit copies until the forward ends
    units_in_flight: int  # sharded units unsharded at once (policy layouts)
    prefetch_elements: int  # DeepSpeed ZeRO-3: elements fetched ahead of the sub-module computing
    frozen_grads: bool  # FSDP1 flat parameters: frozen parameters get (zero) gradients too
    grads_resident: bool  # gradients live for the whole run (Megatron's main-grad buffer)
    replace_ddp_buckets: bool  # the framework's own gradient buffers replace DDP's buckets
    bucket_elements: int  # DeepSpeed: elements of 16-bit reduce buckets held for the run
    # bytes per parameter each collective moves (speed): gradients reduced, parameters gathered
    reduce_comm_bytes: int = 4
    gather_comm_bytes: int = 4
    # FSDP's no_sync() during gradient accumulation (frameworks.Framework.no_sync_accumulation, grad_accum > 1):
    # gradients resident unsharded, `unsharded_grad_bytes` per parameter, across the micro-steps
    accumulate_unsharded: bool = False
    # FSDP1 (FullyShardedDataParallel): the root unit is not resharded after forward (frameworks.Framework.fsdp)
    fsdp1_root: bool = False
    # FSDP2 fully_shard(reshard_after_forward=...) (frameworks.Framework.reshard_after_forward): False keeps each
    # unit gathered from its forward to its backward (timeline.BlockMemory.gathered_until_backward)
    reshard_after_forward: bool = True

    @property
    def legacy(self) -> bool:
        """The planner's historical rule (autocast): sharded units gathered in the parameters' dtype."""
        return self.gather_bytes == 0

    def bucket_bytes(self) -> int:
        return self.bucket_elements * (2 if self.activation_precision in ("bf16", "fp16") else 4)

    def block_bytes(self, share_params: float, share_grads: float, n_params: int, full_param_bytes: int,
                    n_trainable: int, full_grad_bytes: int) -> tuple[int, int, int, int] | None:
        """A block's (resident parameters, resident gradients, gathered parameters, transient gradients), or
        None where the historical rule (memory.parallel.Sharding.block_bytes) applies. `full_*_bytes` are the
        unsharded bytes in the storage dtypes (LoRA: the frozen base's and the adapters')."""
        if self.legacy:
            return None
        sharded = share_params < 1
        resident_p = int(full_param_bytes * share_params)
        grads_n = n_params if (self.frozen_grads and n_trainable) else n_trainable
        if grads_n != n_trainable or self.kind in ("megatron", "deepspeed"):
            grad_full = grads_n * self.grad_bytes  # flat gradients over frozen weights too, or the engine's dtype
        else:
            grad_full = full_grad_bytes  # the parameters' own gradients (fp32 adapters under LoRA)
        resident_g = int(grad_full * share_grads)
        if self.accumulate_unsharded and share_grads < 1:  # no_sync(): whole gradients until the last micro-step
            resident_g = grads_n * self.unsharded_grad_bytes
        # a policy unshards in its own dtype even when nothing is sharded (world size 1): a 16-bit copy of the
        # units in flight, and a unit's 16-bit gradients copied to reduce_dtype
        recast = self.gather_bytes != self.param_bytes
        if not sharded and not recast:
            gathered = 0
        elif self.prefetch_elements or self.kind == "deepspeed":
            gathered = (n_params + min(self.prefetch_elements, n_params)) * self.gather_bytes
        else:
            gathered = self.units_in_flight * n_params * self.gather_bytes
        transient = grads_n * (self.unsharded_grad_bytes + self.reduce_copy_bytes) if (
            share_grads < 1 or recast) else 0
        return resident_p, resident_g, gathered, transient


    def synced_grad_bytes(self, share_grads: float, n_params: int, n_trainable: int, full_grad_bytes: int) -> int:
        """A block's gradient at the optimizer step when FSDP1's no_sync() accumulation kept it whole until the
        last micro-step (-1: the same as during backward). On that micro-step each unit's post-backward hook
        takes the whole 16-bit gradient off the flat parameter (`flat_param.grad = None`), reduce-scatters it,
        casts the shard to the parameter dtype (`_cast_grad_to_param_dtype`: fp32 under MixedPrecision unless
        keep_low_precision_grads) and keeps it as `_saved_grad_shard`, which `prepare_gradient_for_optim` makes
        the `.grad` the optimizer steps: the fp32 shard, as without accumulation. torch v2.0.0
        torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`; today's `_reduce_grad` and
        `_accumulate_sharded_grad` (the same steps; tests/test_fsdp1_sync.py runs them on two CPU ranks)."""
        if not (self.accumulate_unsharded and share_grads < 1):
            return -1
        grads_n = n_params if (self.frozen_grads and n_trainable) else n_trainable
        if grads_n != n_trainable or self.kind in ("megatron", "deepspeed"):
            return int(grads_n * self.grad_bytes * share_grads)
        return int(full_grad_bytes * share_grads)


def _deepspeed(cfg: TrainConfig) -> DeepSpeedSettings:
    return cfg.deepspeed or DeepSpeedSettings()


def layout(cfg: TrainConfig) -> StateLayout:
    """The layout of `cfg` (parallelism resolved; its framework checked by frameworks.check). FSDP2's FP8
    all-gather (`fp8_param_gather`, torchao enable_fsdp_float8_all_gather) gathers units in one byte per
    parameter (every parameter counted so: the FP8 Linears hold all but the embeddings, norms and LM head)."""
    lay = _layout(cfg)
    if cfg.fp8_param_gather and cfg.fp8_recipe is not None and strategy_of(cfg.parallelism).fsdp:
        from dataclasses import replace

        from planner.ir import fp8

        one = fp8.gather_bytes(True)
        return replace(lay, gather_bytes=one, gather_comm_bytes=one)
    return lay


def reshard_after_forward(cfg: TrainConfig) -> bool:
    """Whether FSDP frees each unit's unsharded parameters after its forward: the job's setting
    (TrainConfig.reshard_after_forward, --reshard-after-forward / --no-reshard-after-forward) or the framework's
    default. The setting is FSDP's alone, so it is refused (one line, exit 2) under any other strategy or
    engine: FSDP2 `fully_shard(reshard_after_forward=...)`; FSDP1's ShardingStrategy FULL_SHARD (True) and
    SHARD_GRAD_OP (False: pytorch/pytorch torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`
    reshards only `handle._sharding_strategy in RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES` (FULL_SHARD,
    HYBRID_SHARD), and `_should_free_in_backward` frees the unit after its backward on a syncing step, as FSDP2
    does). DeepSpeed's ZeRO-3 has no such switch (its stage3_max_live_parameters / stage3_max_reuse_distance
    decide what stays fetched) and the planner's generic ZeRO-3 is not FSDP."""
    fw = frameworks.get(cfg.framework)
    given = cfg.reshard_after_forward
    if given is None:
        return fw.reshard_after_forward
    if not strategy_of(cfg.parallelism).fsdp or fw.fsdp is None:
        runs_fsdp = ", ".join(f.name for f in frameworks.FRAMEWORKS.values() if f.fsdp)
        raise PlannerError("--reshard-after-forward", given,
                           f"only with --parallelism fsdp or hsdp under a framework that runs FSDP ({runs_fsdp}); "
                           f"this job runs {cfg.parallelism} under {cfg.framework}")
    return given


def _layout(cfg: TrainConfig) -> StateLayout:
    fw = frameworks.get(cfg.framework)
    strategy = cfg.parallelism
    fsdp = strategy_of(strategy).fsdp
    p = model_states.parameter_dtype_bytes(cfg.precision)
    g = model_states.gradient_dtype_bytes(cfg.precision)
    sixteen = _SIXTEEN.get(cfg.precision)
    amp = cfg.precision.startswith("amp")
    base = dict(framework=fw.name, kind="autocast", param_bytes=p, grad_bytes=g, gather_bytes=0,
                unsharded_grad_bytes=g, reduce_copy_bytes=0, master_bytes=0, state_param_bytes=p, step_grad_bytes=0,
                activation_precision=cfg.precision, autocast_cache=amp, units_in_flight=2, prefetch_elements=0,
                frozen_grads=False, grads_resident=False, replace_ddp_buckets=False, bucket_elements=0,
                reduce_comm_bytes=g, gather_comm_bytes=p)
    engine = fw.engine_for(strategy)
    reshard = reshard_after_forward(cfg)
    if cfg.grad_reduce_in_fp32 is not None and engine != "megatron":
        raise PlannerError("--grad-reduce-in-fp32", cfg.grad_reduce_in_fp32,
                           "only with --framework megatron (Megatron-Core DDP's main-gradient buffer)")
    if engine == "megatron" and sixteen:
        # grad_reduce_in_fp32 False: a 16-bit main-gradient buffer, reduced in 16 bits; the optimizer then steps
        # an fp32 copy of its gradient shard (`shard_model_grad.float()`, a no-op on an fp32 buffer)
        g32 = cfg.grad_reduce_in_fp32 is not False
        grad = 4 if g32 else 2
        return StateLayout(**base | dict(kind="megatron", param_bytes=2, grad_bytes=grad, unsharded_grad_bytes=grad,
                                         master_bytes=4, state_param_bytes=4, activation_precision=sixteen,
                                         step_grad_bytes=0 if g32 else 4, autocast_cache=False,
                                         grads_resident=True, replace_ddp_buckets=True,
                                         reduce_comm_bytes=grad, gather_comm_bytes=2))
    if engine == "deepspeed":
        ds = _deepspeed(cfg)
        width = 2 if sixteen else 4
        stage = strategy_of(strategy).sharding.zero_stage
        overlap = ds.overlap_comm if ds.overlap_comm is not None else stage == 3
        buckets = ds.reduce_bucket_size * (2 if overlap and stage in (1, 2) else 1)
        if stage in (1, 2) and not ds.contiguous_gradients:
            buckets = 0
        return StateLayout(**base | dict(
            kind="deepspeed", param_bytes=width, grad_bytes=width, gather_bytes=width, unsharded_grad_bytes=width,
            master_bytes=4 if sixteen else 0, state_param_bytes=4, step_grad_bytes=4 if sixteen else 0,
            activation_precision=sixteen or cfg.precision, autocast_cache=False,
            prefetch_elements=ds.prefetch_bucket_size if stage == 3 else 0, replace_ddp_buckets=True,
            bucket_elements=buckets, reduce_comm_bytes=width, gather_comm_bytes=width))
    if fsdp and fw.no_sync_accumulation and cfg.grad_accum > 1:
        base["accumulate_unsharded"] = True
    if fsdp and fw.fsdp == "fsdp1":
        base["fsdp1_root"] = True
    if fsdp and not reshard:
        base["reshard_after_forward"] = False
    if fsdp and fw.fsdp_precision != "autocast" and amp:
        reduce = 4 if fw.reduce_fp32 else 2
        if fw.fsdp_precision == "policy":  # units gathered in 16 bits, computed in 16 bits, no autocast
            return StateLayout(**base | dict(
                kind="policy", gather_bytes=2, unsharded_grad_bytes=2, reduce_copy_bytes=reduce if reduce != 2 else 0,
                activation_precision=sixteen, autocast_cache=False, units_in_flight=fw.units_in_flight,
                frozen_grads=fw.flat_params, reduce_comm_bytes=reduce, gather_comm_bytes=2))
        # policy-fp32 (Lightning's bf16-mixed): fp32 units, autocast casting per op without a cache (FSDP1 views)
        return StateLayout(**base | dict(
            kind="policy-fp32", gather_bytes=4, unsharded_grad_bytes=4, reduce_copy_bytes=reduce,
            autocast_cache=False, units_in_flight=fw.units_in_flight, frozen_grads=fw.flat_params,
            reduce_comm_bytes=reduce, gather_comm_bytes=4))
    if fsdp and fw.flat_params:
        # FSDP1 without a 16-bit policy: units gathered in the parameters' dtype, flat gradients
        return StateLayout(**base | dict(kind="fsdp1", gather_bytes=p, units_in_flight=fw.units_in_flight,
                                         frozen_grads=True, autocast_cache=False))
    return StateLayout(**base)


def describe(lay: StateLayout) -> str:
    """One line on what this layout keeps, for notes and the explanation."""
    line = _describe(lay)
    if lay.accumulate_unsharded:
        line += ("; gradient accumulation inside FSDP's no_sync(): every unit's gradient is kept whole (unsharded) "
                 "until the last micro-step, whose reduce-scatter leaves the shards the optimizer steps")
    if not lay.reshard_after_forward:
        line += ("; " if line else "FSDP: ") + (
            "no reshard after forward: each unit stays unsharded from its forward until its backward has run, so "
            "at the end of the forward every unit is held unsharded at once")
    return line


def _describe(lay: StateLayout) -> str:
    if lay.kind == "megatron":
        if lay.grad_bytes == 2:
            return ("Megatron (grad_reduce_in_fp32 off): bf16 parameters (2 B), bf16 main gradients in a buffer "
                    "kept for the run and reduced in bf16 (2 B), fp32 master weights + Adam (12 B, divided by DP "
                    "with the distributed optimizer) and an fp32 copy of the gradient shard for the step (4 B, "
                    "divided by DP with the distributed optimizer)")
        return ("Megatron: bf16 parameters (2 B), fp32 main gradients in a buffer kept for the run (4 B), fp32 "
                "master weights + Adam (12 B, divided by DP with the distributed optimizer)")
    if lay.kind == "deepspeed":
        return (f"DeepSpeed: {lay.param_bytes}-byte parameters and gradients, fp32 master weights and Adam states "
                f"partitioned by the ZeRO stage; reduce buckets of {lay.bucket_elements:,} elements"
                + (f"; ZeRO-3 prefetches {lay.prefetch_elements:,} elements ahead" if lay.prefetch_elements else ""))
    if lay.kind == "policy":
        return (f"FSDP mixed-precision policy: fp32 sharded parameters; only the {lay.units_in_flight} units "
                f"computing or prefetched are unsharded in 16 bits; no autocast weight cache"
                + ("; gradients reduce-scattered in fp32" if lay.reduce_copy_bytes == 4 else "")
                + ("; flat parameters: frozen weights get gradients too" if lay.frozen_grads else ""))
    if lay.kind == "policy-fp32":
        return ("FSDP1 with param_dtype fp32 and autocast (Lightning bf16-mixed): units all-gathered in fp32, "
                "cast per op by autocast without a cache; gradients reduce-scattered in 16 bits")
    if lay.kind == "fsdp1":
        return ("FSDP1 flat parameters: units all-gathered in the parameters' dtype; with frozen weights in a "
                "unit, its flat gradient covers them too")
    if lay.autocast_cache:
        return ("autocast: fp32 parameters; each weight's 16-bit cast is cached until the forward ends"
                " (under FSDP2 the unsharded parameters are leaves: a 16-bit copy of every unit run so far)")
    return ""

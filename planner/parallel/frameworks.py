"""The training frameworks, one record each: whose layouts and defaults apply to a parallelism strategy.

The planner's strategies (planner.parallel.registry) say WHAT is sharded; a framework says HOW its code does
it: how `--precision amp-*` is applied (op-level autocast, or FSDP's module-level mixed-precision policy, or a
16-bit model with fp32 master weights in the optimizer), which FSDP (FSDP1 `FullyShardedDataParallel` or FSDP2
`fully_shard`) and with which options, which strategies it offers at all. Memory
(planner.memory.framework_layout), speed and the explanation read these records, never a framework's name.

Every field cites the source line it follows (`sources`). Adding a framework: one record here and its name in
spec.Framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from planner.errors import PlannerError

# How --precision amp-* is applied under a sharded-parameter strategy (fsdp):
# - "autocast": torch.autocast around a loop; FSDP gathers the parameters in their own dtype (fp32).
# - "policy": FSDP's mixed-precision policy; units are all-gathered in `param_dtype` (16-bit), no autocast.
# - "policy-fp32": Lightning's "bf16-mixed"/"16-mixed": a policy with param_dtype fp32, 16-bit reduce, and
#   autocast around the forward.
FsdpPrecision = Literal["autocast", "policy", "policy-fp32"]
# How a framework holds model states outside FSDP:
# - "autocast": fp32 parameters and gradients, torch.autocast casts (a plain loop, Accelerate, Lightning).
# - "megatron": bf16/fp16 parameters, fp32 main gradients, fp32 master weights in the optimizer.
# - "deepspeed": DeepSpeed's fp16/bf16 engine: 16-bit parameters and gradients, fp32 master partition.
Engine = Literal["autocast", "megatron", "deepspeed"]


@dataclass(frozen=True)
class Framework:
    """One framework and the traits the planner reads from it (module docstring)."""

    name: str
    label: str
    # planner strategy -> what this framework runs for it; a strategy not listed is refused (exit 2)
    strategies: Mapping[str, str]
    engine: Engine = "autocast"
    fsdp: Literal["fsdp1", "fsdp2"] | None = None  # which FSDP runs `--parallelism fsdp`
    fsdp_precision: FsdpPrecision = "autocast"
    reduce_fp32: bool = False  # gradients reduce-scattered in fp32 (a policy's reduce_dtype=float32)
    # FSDP1 `use_orig_params=True`: frozen and trainable parameters share one FlatParameter per unit, and the
    # flat gradient covers the frozen ones too. FSDP2 shards and grads per parameter.
    flat_params: bool = False
    reshard_after_forward: bool = True  # FULL_SHARD / fully_shard default
    units_in_flight: int = 2  # unsharded units at once: the one computing + the one prefetched
    # gradient accumulation runs the micro-steps before the last inside FSDP's no_sync(): every unit's gradient
    # is kept whole (unsharded) until the last micro-step reduce-scatters it
    no_sync_accumulation: bool = False
    # DeepSpeed strategies run through a framework's DeepSpeed integration (Accelerate, Lightning)
    deepspeed_strategies: tuple[str, ...] = ()
    loss: str = "cross-entropy on the model's logits, upcast to fp32 (transformers' ForCausalLMLoss)"
    # Which memory-bound kernels a step runs between the GEMMs: "eager" (one per PyTorch op, autocast casts:
    # planner.perf.kernels) or "megatron" (TransformerEngine's and Megatron-Core's fused kernels, bf16
    # parameters and residual stream: planner.perf.fused)
    kernels: Literal["eager", "megatron"] = "eager"
    # Sequence parallelism: whether a column-parallel linear saves its all-gathered input (n rows) for
    # backward, or its local n / tp shard, gathered again in backward (Megatron-Core's rule, the default;
    # planner.ir.context.Ctx.sp_saves_gathered cites both).
    sp_saves_gathered_input: bool = False
    # Mixture-of-experts: whether the routed experts' grouped GEMMs run in the 16-bit compute dtype whatever
    # dtype the expert weights are held in (True: the framework's own MoE casts them: torchtitan's
    # GroupedExperts, Megatron-Core's GroupedMLP/TEGroupedMLP under Float16Module), or in the weights' dtype
    # (False: transformers' `grouped_mm_experts_forward` casts the input to the weights' dtype and
    # `grouped_mm` is not autocast, so fp32 weights under `amp-*` compute in fp32; 16-bit weights, as an FSDP
    # policy gathers them, compute in 16 bits). planner.ir.context.Ctx.experts_16bit carries it.
    experts_16bit: bool = False
    # Transformer Engine's FP8 weight cache: the framework passes te.Linear `is_first_microbatch` (True on a
    # step's first micro-batch, False after), so TE casts each weight to FP8 (and its transpose) once per step
    # into a workspace the module keeps (`get_weight_workspace(cache_name="weight")`) and every micro-batch's
    # backward reads that one copy. False: `is_first_microbatch` None, a fresh FP8 copy per forward, saved
    # for its backward (per micro-batch in flight). planner.ir.context.Ctx.fp8_weight_cache carries it.
    te_weight_cache: bool = False
    # The framework runs its own fused attention, whatever transformers' default for the model class (gpt-oss,
    # whose class has no SDPA path, runs eager in transformers): `--attention auto` resolves to the fused
    # kernel ("flash": q, k, v, output and the row statistics saved) on a GPU that runs it.
    fused_attention: bool = False
    # Mixture-of-experts: the framework's own fused MoE kernels (Megatron-Core with moe_permute_fusion,
    # moe_grouped_gemm and bias_activation_fusion, as Megatron-Bridge's providers and performance recipes set
    # them; NeMo AutoModel's DeepEP experts): TE's mask-map permutation saves only its int32 row-id map, the
    # unpermutation nothing more (the probabilities are applied inside the experts' activation, not at the
    # combine); the weighted SwiGLU / quick-GeGLU (Megatron's fused kernels, or NeMo's torch.compile'd one)
    # saves its input and the pairs' probabilities only. False: transformers' (and torchtitan's) eager ops,
    # each saving what its derivative needs. planner.ir.context.Ctx.fused_moe carries it.
    fused_moe: bool = False
    # With fused_moe: the router is TE's fused top-k (Megatron-Core's moe_router_fusion), which saves its routing
    # map (E bools a token) and one fp32 E-wide intermediate. False: the framework's own router in eager ops
    # (NeMo AutoModel's Gate), saving what transformers' router saves. planner.ir.context.Ctx.fused_router.
    fused_router: bool = False
    # Transformer Engine's fused RMSNorm (Megatron-Core's TE layer spec: the input norm inside
    # TELayerNormColumnParallelLinear, TENorm for the pre-MLP norm of an MoE layer and the q/k layernorms): it saves
    # its 16-bit input and the fp32 rstd per row, not transformers' fp32 copy of the input and normalised tensor.
    # planner.ir.context.Ctx.fused_norms carries it (LayerNorm models keep the eager rule: not modelled).
    fused_norms: bool = False
    # The causal LM loss upcasts the logits to fp32 first (transformers' ForCausalLMLoss `logits.float()`), so
    # log_softmax saves (and its backward writes) fp32 n·V tensors. False: cross-entropy on the logits as they
    # are (16-bit in pure bf16; under CUDA autocast a 16-bit log-softmax and nll_loss's fp32 copy of it:
    # planner.memory.activations.cross_entropy_saved). planner.ir.context.Ctx.loss_fp32.
    loss_fp32: bool = True
    # How the framework splits the transformer layers over pipeline model chunks when they do not divide
    # (issue 35; planner.parallel.layer_split has each rule and its source): "even" refuses them.
    pipeline_split: str = "even"
    # The causal LM loss is Transformer Engine's fused cross-entropy (Megatron-Core `cross_entropy_loss_fusion`
    # with `cross_entropy_fusion_impl='te'`, as Megatron-Bridge sets them): its Triton kernels keep the logits
    # (the model's own output, no new storage) and three fp32 statistics a row, and write the gradient into the
    # logits in place: no n·V softmax saved, no n·V gradient allocated. planner.ir.context.Ctx.fused_loss.
    fused_loss: bool = False
    # A dense layer's SwiGLU is Megatron-Core's fused `bias_swiglu_impl` (MLP.forward under
    # bias_activation_fusion, which Megatron-Bridge's Llama/Qwen providers set True): one autograd function that
    # saves its input (the fc1 output, gate and up halves, in its own 16-bit dtype; FP8 only with
    # activation_func_fp8_input_store, default False) and rebuilds silu(gate), the product and both in
    # backward. False: the eager silu and product, each saving what its derivative needs.
    # planner.ir.context.Ctx.fused_glu carries it.
    fused_glu: bool = False
    sources: tuple[str, ...] = field(default_factory=tuple)
    notes: str = ""

    def runs(self, strategy: str) -> str | None:
        """What this framework runs for a planner strategy, or None if it has no such strategy."""
        return self.strategies.get(strategy)

    def engine_for(self, strategy: str) -> Engine:
        """The engine holding model states under `strategy` (DeepSpeed's for the strategies a framework hands
        to its DeepSpeed integration)."""
        return "deepspeed" if strategy in self.deepspeed_strategies else self.engine


_FSDP2_SOURCES = (
    "pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_api.py MixedPrecisionPolicy: 'Unlike autocast, this "
    "applies mixed precision at the module level ... low-precision activations are saved for backward'; "
    "param_dtype casts the sharded parameter before the all-gather, reduce_dtype the gradients before the "
    "reduce-scatter",
    "pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fully_shard.py fully_shard(reshard_after_forward=True): "
    "parameters freed after forward and all-gathered again in backward; the next unit's all-gather is "
    "issued while the current one computes (implicit prefetching, one unit ahead)",
    "pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: unsharded "
    "gradients copied into a reduce-scatter input of reduce_dtype, then freed",
)
_AUTOCAST_CACHE = ("pytorch/pytorch aten/src/ATen/autocast_mode.cpp cached_cast: a cast is cached when the "
                   "argument is a leaf that requires grad; the cache is cleared when the outermost autocast exits")
_FSDP1_FLAT = ("pytorch/pytorch torch/distributed/fsdp/fully_sharded_data_parallel.py (use_orig_params docstring): "
               "'FSDP supports mixing frozen and non-frozen, but we recommend not doing so since then the gradient "
               "memory usage will be higher than expected (namely, equivalent to not freezing those parameters)'")

FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework(
        "pytorch", "a plain PyTorch loop",
        strategies={"single": "one GPU", "dp": "nn.DataParallel", "ddp": "DistributedDataParallel",
                    "zero1": "ZeroRedundancyOptimizer over DDP", "zero2": "ZeRO-2 (the planner's generic rule)",
                    "zero3": "ZeRO-3 (the planner's generic rule)",
                    "fsdp": "FSDP2 fully_shard, with torch.autocast around the step",
                    "hsdp": "FSDP2 fully_shard on a 2-D DeviceMesh (replicate, shard), torch.autocast"},
        fsdp="fsdp2", fsdp_precision="autocast",
        sources=(*_FSDP2_SOURCES, _AUTOCAST_CACHE,
                 "pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_param.py FSDPParam.to_unsharded: the "
                 "unsharded parameter is registered as an nn.Parameter (a leaf): autocast caches its cast"),
        notes="fp32 parameters; autocast casts each weight to 16 bits at its first use and caches the cast until "
              "the forward ends. Under FSDP the unsharded parameters are leaves, so the cache keeps a 16-bit "
              "copy of every unit the forward has run (a 16-bit copy of the whole model at its end)."),
    Framework(
        "torchtitan", "torchtitan",
        strategies={"single": "one GPU, torch.autocast", "ddp": "replicate (DDP), torch.autocast",
                    "fsdp": "FSDP2 fully_shard with MixedPrecisionPolicy(param bf16, reduce fp32)",
                    "hsdp": "FSDP2 fully_shard on the (dp_replicate, dp_shard) mesh, the same policy"},
        fsdp="fsdp2", fsdp_precision="policy", reduce_fp32=True, sp_saves_gathered_input=True,
        experts_16bit=True, fused_attention=True, pipeline_split="torchtitan",
        sources=(*_FSDP2_SOURCES,
                 "pytorch/torchtitan torchtitan/models/gpt_oss/model/model.py (@6404b932): attention through "
                 "FlexAttention, the sinks applied by renormalising with its logsumexp (fused_attention)",
                 "pytorch/torchtitan torchtitan/models/moe/moe.py _run_experts_grouped_mm (@6404b932): "
                 "torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets) for w1, w3 and "
                 "w2, `.type_as(x)` after: the routed experts compute in bf16 under every precision setting",
                 "pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py apply_tp: attention_norm "
                 "SequenceParallel(), then PrepareModuleInput(Shard(1) -> Replicate()) and ColwiseParallel wq/wk/wv: "
                 "the linears read (and their mm saves) the all-gathered input",
                 "pytorch/torchtitan torchtitan/config/job_config.py Training.mixed_precision_param = 'bfloat16', "
                 "mixed_precision_reduce = 'float32' (@6404b932): applied 'via fully_shard when "
                 "data_parallel_shard_degree > 1', via torch.autocast under DDP or one device",
                 "pytorch/torchtitan torchtitan/distributed/utils.py maybe_enable_amp: 'FSDP handles mixed "
                 "precision internally' (nullcontext) else torch.autocast"),
        notes="FSDP2 with a mixed-precision policy: fp32 sharded parameters, each unit all-gathered in bf16 "
              "while it computes (and the next one prefetched), gradients reduce-scattered in fp32."),
    Framework(
        "megatron", "Megatron-LM (Megatron Core)",
        strategies={"single": "one GPU, Float16Module", "ddp": "Megatron DDP, fp32 main-gradient buffer",
                    "zero1": "Megatron DDP + distributed optimizer (--use-distributed-optimizer)"},
        engine="megatron", kernels="megatron", experts_16bit=True, te_weight_cache=True,
        fused_attention=True, fused_moe=True, fused_router=True, fused_norms=True, fused_loss=True,
        fused_glu=True, pipeline_split="megatron",
        loss="Transformer Engine's fused cross-entropy on the 16-bit logits, its gradient written into them",
        sources=("NVIDIA/Megatron-LM docs/source/api-guide/dist_optimizer.md: bytes per parameter 'non-distributed "
                 "optim: 18; distributed optim: 6 + 12/d' for bf16 params with fp32 main grads "
                 "(param 2 + grad 4 + fp32 master 4 + Adam 4 + 4)",
                 "NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel.py: a contiguous main-grad "
                 "buffer allocated when the model is wrapped (grad_reduce_in_fp32 -> fp32), kept for the run",
                 "grad_reduce_in_fp32 (TrainConfig.grad_reduce_in_fp32, --grad-reduce-in-fp32): NVIDIA/Megatron-LM "
                 "megatron/core/distributed/distributed_data_parallel_config.py `grad_reduce_in_fp32: bool = False` "
                 "(the core's default), but megatron/training/arguments.py validate_args under --bf16: 'bfloat16 "
                 "requires gradient accumulation and all-reduce to be done in fp32' (accumulate_allreduce_grads_"
                 "in_fp32 = True) and NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/training/mixed_precision.py "
                 "(@00b7660b) MixedPrecisionConfig `grad_reduce_in_fp32: bool = True`, bf16_mixed() True: fp32 is "
                 "the default here; its performance recipes set it False (scripts/performance/configs/gpt_oss/"
                 "gpt_oss_llm_pretrain.py, qwen/qwen3_llm_pretrain.py `cfg.ddp.grad_reduce_in_fp32 = False`)",
                 "NVIDIA/Megatron-LM megatron/core/optimizer/distrib_optimizer.py _copy_model_grads_to_main_grads: "
                 "`shard_main_param.grad = shard_model_grad.float()` (optimizer.py Float16OptimizerWithFloat16Params: "
                 "`main_param.grad = model_param.main_grad.float()`): with a bf16 buffer the step reads an fp32 copy "
                 "of the rank's gradient shard (of every gradient without the distributed optimizer); on an fp32 "
                 "buffer `.float()` returns the buffer itself",
                 "NVIDIA/Megatron-LM megatron/core/transformer/module.py Float16Module: the model's parameters "
                 "converted to bf16/fp16, no autocast",
                 "NVIDIA/Megatron-LM megatron/core/transformer/moe/experts.py (@d98e8a64) GroupedMLP "
                 "(gg.ops.gmm on the bf16 weights Float16Module made) and TEGroupedMLP (TE's GroupedLinear, "
                 "inside fp8_autocast under --fp8-format): the routed experts compute in 16 bits (or FP8)",
                 "NVIDIA/Megatron-LM megatron/core/extensions/transformer_engine.py (@d98e8a64) TELinear.forward: "
                 "`_is_first_microbatch = None if self.disable_parameter_transpose_cache else "
                 "self.is_first_microbatch`; `self.is_first_microbatch = False` after the call (reset each step "
                 "by the schedules' set_is_first_microbatch); disable_parameter_transpose_cache defaults False",
                 "NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py _Linear.forward: "
                 "`update_workspace = is_first_microbatch is None or is_first_microbatch`; `weightmat = "
                 "module.get_weight_workspace(..., cache_name=(None if is_first_microbatch is None else "
                 "'weight'), update_workspace=update_workspace)`: one cached FP8 weight (rowwise and columnwise "
                 "copies) per module, reused by every micro-batch",
                 "NVIDIA/Megatron-LM megatron/core/transformer/moe/experts.py (@d98e8a64) TEGroupedMLP.forward "
                 "bias_act_func: with bias_activation_fusion, `weighted_bias_swiglu_impl(intermediate_parallel, "
                 "bias_parallel, permuted_probs, ...)` (or weighted_bias_quick_geglu_impl for gpt-oss's clamped "
                 "quick-GeGLU); megatron/core/fusions/fused_bias_swiglu.py WeightedSwiGLUFunction.forward "
                 "`ctx.save_for_backward(input_for_backward, weights)` (fused_bias_geglu.py: input, weights, "
                 "linear_offset): the fc1 output and the probabilities, no activation output or product (fused_moe)",
                 "NVIDIA/Megatron-LM megatron/core/transformer/moe/token_dispatcher.py (@d98e8a64) "
                 "MoEAlltoAllTokenDispatcher: `permute(hidden_states, self.routing_map, probs=probs, ..., "
                 "fused=self.config.moe_permute_fusion)` and `unpermute(..., fused=...)` with no probs "
                 "(moe_utils.py: TE fused_permute_with_probs / fused_unpermute(merging_probs=None)); "
                 "NVIDIA/TransformerEngine transformer_engine/pytorch/triton/permutation.py make_row_id_map: "
                 "'row_id_map ... of shape [num_tokens, num_experts * 2 + 1]' int32, the one tensor both keep",
                 "NVIDIA/TransformerEngine transformer_engine/pytorch/router.py FusedTopkScoreFunction.forward: "
                 "`ctx.save_for_backward(routing_map, intermediate_output)` (E bools and E fp32 a token), under "
                 "Megatron-Core's moe_router_fusion (router.py `fused=self.config.moe_router_fusion`), which "
                 "Megatron-Bridge's performance recipes set (scripts/performance/configs/*/…_llm_pretrain.py "
                 "`cfg.model.moe_router_fusion = True`, @00b7660b)",
                 "NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/gpt_provider.py (@00b7660b) "
                 "`cross_entropy_loss_fusion: bool = True` and scripts/performance/utils/overrides.py "
                 "`recipe.model.cross_entropy_fusion_impl = \"te\"` (the qwen3_moe recipes set it too); "
                 "NVIDIA/Megatron-LM megatron/core/models/common/language_module/language_module.py "
                 "compute_language_model_loss: `if self.config.cross_entropy_fusion_impl == 'te': loss = "
                 "te_parallel_cross_entropy(logits, labels, ...)`; NVIDIA/TransformerEngine "
                 "transformer_engine/pytorch/cross_entropy.py CrossEntropyFunction.forward "
                 "`ctx.save_for_backward(_input.detach())` and triton/cross_entropy.py (@02965d2e): "
                 "`m_d_X_y = torch.zeros(n_rows * 3, dtype=torch.float32)`, the backward kernel `tl.store(X_ptr "
                 "+ X_offsets, grad_input.to(input_dtype))` into the logits (fused_loss)",
                 "NVIDIA/Megatron-LM megatron/core/models/gpt/gpt_layer_specs.py (@d98e8a64) "
                 "get_gpt_layer_with_transformer_engine_spec: linear_qkv TELayerNormColumnParallelLinear, "
                 "q_layernorm/k_layernorm and an MoE layer's pre_mlp_layernorm TENorm; NVIDIA/TransformerEngine "
                 "transformer_engine/pytorch/ops/basic/rmsnorm.py RMSNorm.op_forward `ctx.save_for_backward(x, "
                 "rstdevs)` (fused_norms)",
                 "NVIDIA/Megatron-LM megatron/core/transformer/mlp.py (@d98e8a64) MLP.forward: `elif "
                 "self.config.bias_activation_fusion: ... elif self.activation_func == F.silu and "
                 "self.config.gated_linear_unit: intermediate_parallel = bias_swiglu_impl(intermediate_parallel, "
                 "bias_parallel, self.config.activation_func_fp8_input_store, ...)`; megatron/core/fusions/"
                 "fused_bias_swiglu.py SwiGLUFunction.forward `input_for_backward = input.to(torch.float8_e4m3fn) "
                 "if fp8_input_store else input; ctx.save_for_backward(input_for_backward)`; transformer_config.py "
                 "`activation_func_fp8_input_store: bool = False`; NVIDIA-NeMo/Megatron-Bridge "
                 "src/megatron/bridge/models/llama/llama_provider.py (@00b7660b) `bias_activation_fusion: bool = "
                 "True` (gpt_provider.py's Qwen/Llama providers the same) (fused_glu)",
                 "NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py _Linear.forward (2.x): the "
                 "input is quantized by the module's input quantizer and the quantized copy, column-wise usage "
                 "only, is what it saves (`inputmat.update_usage(rowwise_usage=False)`), whatever another op "
                 "saves of the 16-bit tensor: the attention output projection (linear_proj, TERowParallelLinear) "
                 "keeps an FP8 copy besides the attention's own bf16 output (planner.memory.op_saved.linear_saved)"),
        notes="bf16 parameters (2 B), fp32 main gradients (4 B) in a buffer that lives for the run, fp32 master "
              "weights and Adam states (12 B) in the optimizer: 18 B per parameter, 6 + 12/DP with the "
              "distributed optimizer. No FSDP1/FSDP2 (Megatron's own FSDP is not modelled)."),
    Framework(
        "deepspeed", "DeepSpeed",
        strategies={"single": "DeepSpeed engine, ZeRO stage 0", "ddp": "DeepSpeed engine, ZeRO stage 0",
                    "zero1": "ZeRO stage 1", "zero2": "ZeRO stage 2", "zero3": "ZeRO stage 3"},
        engine="deepspeed", deepspeed_strategies=("single", "ddp", "zero1", "zero2", "zero3"),
        sources=("microsoft/DeepSpeed deepspeed/runtime/zero/config.py DeepSpeedZeroConfig defaults: "
                 "reduce_bucket_size 5e8, allgather_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, "
                 "stage3_param_persistence_threshold 1e5, stage3_max_live_parameters 1e9, contiguous_gradients "
                 "True",
                 "microsoft/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py: 16-bit model, fp32 partition of "
                 "the master weights (single_partition_of_fp32_groups), ipg_buffer of reduce_bucket_size "
                 "elements (two with overlap_comm) when contiguous_gradients",
                 "microsoft/DeepSpeed deepspeed/runtime/zero/stage3.py: parameters partitioned in 16 bits, "
                 "fetched per sub-module with prefetch up to stage3_prefetch_bucket_size elements; fp32 "
                 "partitioned master weights and gradients; a reduce bucket of reduce_bucket_size elements",
                 "Rajbhandari et al. 2020 (ZeRO) §3.1: mixed-precision Adam holds 2 + 2 + 12 = 16 B per parameter"),
        notes="fp16/bf16 engine: 16-bit parameters and gradients, fp32 master weights and Adam states "
              "partitioned by the ZeRO stage; bucket buffers from the ds_config. No FSDP."),
    Framework(
        "accelerate", "Hugging Face Accelerate",
        strategies={"single": "one GPU, autocast", "dp": "nn.DataParallel", "ddp": "DDP, autocast",
                    "zero1": "DeepSpeed ZeRO-1 (DeepSpeedPlugin)", "zero2": "DeepSpeed ZeRO-2 (DeepSpeedPlugin)",
                    "zero3": "DeepSpeed ZeRO-3 (DeepSpeedPlugin)",
                    "fsdp": "FSDP1 FullyShardedDataParallel, MixedPrecision(param, reduce, buffer = bf16)"},
        fsdp="fsdp1", fsdp_precision="policy", reduce_fp32=False, flat_params=True, no_sync_accumulation=True,
        deepspeed_strategies=("zero1", "zero2", "zero3"),
        sources=("huggingface/accelerate src/accelerate/accelerator.py Accelerator.accumulate: 'contextlib."
                 "nullcontext() if self.sync_gradients else self.no_sync(m)' (quoted in huggingface/transformers"
                 "#29425), the Trainer's loop since transformers 4.30; before it, transformers' Trainer wrapped "
                 "the same micro-steps in model.no_sync() (training_args._no_sync_in_gradient_accumulation: "
                 "True unless DeepSpeed or SageMaker); pytorch/pytorch FullyShardedDataParallel.no_sync: 'FSDP "
                 "will accumulate the full model gradients (instead of gradient shards) until the eventual sync'; "
                 "huggingface/accelerate#2531 GradientAccumulationPlugin(sync_each_batch=True) turns it off",
                 "huggingface/accelerate src/accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin."
                 "set_mixed_precision: MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) "
                 "for mixed_precision fp16/bf16",
                 "huggingface/accelerate src/accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin: "
                 "use_orig_params (accelerate config's fsdp_use_orig_params, true by default in `accelerate "
                 "config`; ASSUMPTION where a job does not say), backward_prefetch BACKWARD_PRE, "
                 "sharding_strategy FULL_SHARD",
                 "huggingface/accelerate src/accelerate/accelerator.py prepare_model: the forward is also wrapped "
                 "in autocast; with 16-bit parameters its casts are no-ops (nothing cached)",
                 _FSDP1_FLAT),
        notes="FSDP1 with MixedPrecision(bf16 everywhere): fp32 flat shards, each unit all-gathered in 16 bits, "
              "gradients reduced in 16 bits. With LoRA and use_orig_params, the flat gradient covers the frozen "
              "weights too."),
    Framework(
        "lightning", "PyTorch Lightning / Fabric",
        strategies={"single": "one GPU, autocast", "ddp": "DDPStrategy, autocast",
                    "zero1": "DeepSpeedStrategy stage 1", "zero2": "DeepSpeedStrategy stage 2",
                    "zero3": "DeepSpeedStrategy stage 3",
                    "fsdp": "FSDPStrategy (FSDP1), FSDPPrecision: param fp32, reduce 16-bit, autocast"},
        fsdp="fsdp1", fsdp_precision="policy-fp32", reduce_fp32=False, flat_params=True,
        deepspeed_strategies=("zero1", "zero2", "zero3"),
        sources=("Lightning-AI/pytorch-lightning src/lightning/fabric/plugins/precision/fsdp.py @03f57f9c "
                 "FSDPPrecision.mixed_precision_config: 'bf16-mixed': param_dtype = torch.float32, reduce_dtype "
                 "= buffer_dtype = torch.bfloat16; 'bf16-true': all bf16",
                 "Lightning-AI/pytorch-lightning src/lightning/fabric/plugins/precision/amp.py MixedPrecision."
                 "forward_context: torch.autocast around the forward",
                 "pytorch/pytorch torch/distributed/fsdp/_flat_param.py FlatParamHandle._use_unsharded_views: in "
                 "forward the original parameters are views of the flat parameter (not leaves): autocast does "
                 "not cache their casts",
                 _FSDP1_FLAT),
        notes="FSDP1 with Lightning's 'bf16-mixed': units all-gathered in fp32 and cast by autocast per op "
              "(the casts are saved for backward, not cached), gradients reduced in bf16."),
    Framework(
        "nemo-automodel", "NVIDIA NeMo AutoModel",
        strategies={"single": "one GPU, a bf16 model", "ddp": "DDP over the bf16 model",
                    "fsdp": "FSDP2 fully_shard, MixedPrecisionPolicy(param bf16, reduce fp32), "
                            "reshard_after_forward=False"},
        fsdp="fsdp2", fsdp_precision="policy", reduce_fp32=True, reshard_after_forward=False,
        experts_16bit=True, fused_attention=True, fused_moe=True, fused_norms=True, loss_fp32=False,
        pipeline_split="nemo-automodel",
        loss="masked cross-entropy on the 16-bit logits (MaskedCrossEntropy, fp32_upcast false in the "
             "benchmark recipes)",
        sources=(*_FSDP2_SOURCES,
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/moe/parallelizer.py (@cb976544) apply_fsdp: "
                 "`mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
                 "output_dtype=torch.bfloat16, cast_forward_inputs=True)` and `reshard_after_forward: bool = "
                 "False` (parallelize_model and MoEParallelizerConfig default False too); under EP the experts "
                 "are `ignored_params` of their block's FSDP unit",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/distributed/config.py (@cb976544) _STRATEGY_MAP: "
                 "fsdp2, megatron_fsdp and ddp (DDPConfig); its Megatron-FSDP is not modelled",
                 "NVIDIA-NeMo/Automodel nemo_automodel/_transformers/auto_model.py (@cb976544) from_config: "
                 "`torch_dtype = ... if torch_dtype != 'auto' else torch.bfloat16`: the model, its sharded "
                 "parameters and torch.optim.Adam's states are bf16 (the benchmark recipes run --precision bf16)",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/moe/experts.py (@cb976544) "
                 "GroupedExpertsDeepEP.forward: `compute_dtype = permuted_local_hidden_states.dtype`; "
                 "`self.gate_and_up_projs.to_local().to(compute_dtype)`, then grouped_gemm `ops.gmm` "
                 "(backend experts: gmm): the routed experts compute in 16 bits (experts_16bit)",
                 "NVIDIA-NeMo/Automodel examples/llm_benchmark/{qwen/qwen3_moe_30b,gpt_oss/gptoss_20b,"
                 "gpt_oss/gptoss_120b}_te_deepep.yaml (@cb976544) backend: attn te or flex, linear te, rms_norm "
                 "te, experts gmm, dispatcher deepep; nemo_automodel/components/models/gpt_oss/layers.py: "
                 "`assert backend.attn in ('flex', 'te')`, sinks passed to FlexAttention (fused_attention)",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/models/common/utils.py (@cb976544) "
                 "rms_norm 'te': `transformer_engine.pytorch.module.rmsnorm.RMSNorm`; NVIDIA/TransformerEngine "
                 "transformer_engine/pytorch/ops/basic/rmsnorm.py `ctx.save_for_backward(x, rstdevs)` "
                 "(fused_norms)",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/moe/experts.py (@cb976544; layers.py "
                 "@2c236e08, the code of the published runs) get_expert_activation_for_deepep: 'swiglu' "
                 "(Qwen3-MoE) is Megatron's fused weighted_bias_swiglu_impl (`ctx.save_for_backward(input, "
                 "weights)`); 'quick_geglu' (gpt-oss, models/gpt_oss/model.py `expert_activation="
                 "\"quick_geglu\"`) is `@torch.compile(fullgraph=True, ...) def quick_geglu_deepep(x, "
                 "permuted_probs, ...)`: clamp, sigmoid, products and `(inter * permuted_probs)` in one "
                 "compiled region, whose min-cut partition saves x and permuted_probs only (checked with "
                 "torch's inductor partitioner, tests/test_moe_nemo.py): both save their input and the "
                 "probabilities (fused_moe)",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/moe/experts.py (@cb976544) "
                 "GroupedExpertsDeepEP.init_token_dispatcher: `MegatronMoEConfig(..., moe_permute_fusion=True, "
                 "moe_enable_deepep=True)`; moe/megatron/token_dispatcher.py _DeepepManager: `permute("
                 "hidden_states, self.dispatched_routing_map, probs=self.dispatched_probs, ..., fused=True)` "
                 "('DeepEP only supports float32 probs') and `unpermute(..., fused=True)` without probs: TE's "
                 "row-id-map permutation, the probabilities applied in the activation (fused_moe). The router "
                 "is NeMo's own Gate in eager ops (fused_router False; the benchmark recipes' "
                 "fake_balanced_gate has no weights and saves nothing: the model option fake_balanced_gate=true, "
                 "TransformerSpec.fake_balanced_gate). DeepEP's communication buffers (deep_ep.Buffer, "
                 "cudaMalloc'd outside PyTorch's allocator) are not modelled",
                 "NVIDIA-NeMo/Automodel nemo_automodel/components/loss/masked_ce.py (@cb976544) "
                 "MaskedCrossEntropy.forward: `if self.fp32_upcast: logits = logits.float()`, then "
                 "`F.cross_entropy(logits, labels)`; the benchmark recipes set `fp32_upcast: false`: the loss "
                 "runs on the bf16 logits (loss_fp32 False)"),
        notes="A bf16 model under FSDP2 with a bf16/fp32 mixed-precision policy, its own MoE layer (DeepEP "
              "dispatch, grouped GEMMs in bf16), Transformer Engine's RMSNorm and TE or FlexAttention. "
              "reshard_after_forward=False: every unit stays gathered from its forward to its backward."),
)}

DEFAULT = "pytorch"


def get(name: str) -> Framework:
    """The record of a framework name; PlannerError (exit 2) naming --framework otherwise."""
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise PlannerError("--framework", name, ", ".join(FRAMEWORKS)) from None


def check(framework: str, strategy: str) -> Framework:
    """The framework's record, refusing a strategy it does not have (e.g. Megatron with FSDP)."""
    f = get(framework)
    if f.runs(strategy) is None:
        raise PlannerError("--parallelism", strategy,
                           f"a strategy {f.label} runs ({', '.join(f.strategies)}) with --framework {f.name}")
    return f

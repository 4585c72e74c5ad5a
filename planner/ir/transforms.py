"""Transforms: functions from a program to a program.

Activation checkpointing (transformers' gradient checkpointing, torch.utils.checkpoint non-reentrant): each
transformer layer keeps only its inputs (a `checkpoint` op at its start) and its ops are marked
`recomputed`: they save nothing during the forward and run again in backward (torch/utils/checkpoint.py
`_checkpoint_without_reentrant_generator`; early stop, on by default, skips the trailing ops whose outputs
nothing saves: Llama's down projection and residual add are not `recomputed`).
Selective recomputation (issue 34, `selective_layer` / `recompute_selected`): only the named modules of each
layer are recomputed: Megatron-Core's `recompute_modules` (megatron/core/transformer/transformer_config.py:
"core_attn" (the default), "mlp", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj"). A region
keeps its inputs (a `checkpoint` op with `region` set, placed before it) and its ops save nothing and run again
in backward (`checkpointed`, `recomputed`), as torch.utils.checkpoint / Megatron's `tensor_parallel.checkpoint`
do for "core_attn" and "mlp". "layernorm" is Megatron's output-discarding checkpoint
(`CheckpointWithoutOutput`): the norm keeps only its input, and the norm's output, which the next Linear(s)
saved, is freed after the forward and rebuilt in backward (the Linears' and an MoE router's `input_discarded`).
In a mixture-of-experts layer (megatron/core/transformer/moe/moe_layer.py and experts.py @d98e8a64): "moe" checkpoints
the whole MoE block on its input (`moe_layer_recompute`: `tensor_parallel.checkpoint(custom_forward, False,
hidden_states, ...)`), "shared_experts" the shared expert on its input (`shared_experts_recompute`), "moe_act" the
experts' activation with `CheckpointWithoutOutput` (TEGroupedMLP.forward: its input, the fc1 output, and the
probabilities kept; its output, which fc2 saved, freed after fc2 and rebuilt in backward: the down GEMM's
`input_discarded`; under FP8 `set_save_original_input(self.linear_fc2)` makes fc2 save that 16-bit output, freed
too). Names of modules a model does not have select nothing; "mla_up_proj" (DeepSeek's latent attention's up
projections) is accepted and NOT modelled: it selects nothing.

torchtitan's per-op policy ("op", `--recompute-modules op`; torchtitan/models/llama3/infra/parallelize.py
`_save_list` and `apply_ac` with selective_ac_option "op"): the whole layer is checkpointed with
torch.utils.checkpoint's selective policy, which keeps the outputs of every other `aten.mm` (the 1st, 3rd,
...: a Linear without bias; one with a bias runs addmm, which the list lacks) and of the fused SDPA kernels
(flash, memory-efficient), and recomputes every other op in backward (`op_policy_layer`).

Tensor-parallel sharding is not a transform: the layer forms emit one rank's ops from the context record
(planner.ir.context.Ctx tp, sp, cp), because which ops run (the collectives, the SP all-gathers) and their
shapes are the form's business exactly as the attention kernel and the autocast dtypes are; a transform that
rewrote shapes afterwards would have to re-derive every width the form already knows.

LoRA / QLoRA (`lora_layers`): frozen base parameters, adapter ops, 4-bit weights dequantized. Tensor-parallel
sharding and FP8 copies are the next transforms to move here (issue 33).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from planner.families import family
from planner.ir.context import F32, Ctx
from planner.ir.ops import Op, Param, Program, ProgramBlock

# Megatron-Core's module names (transformer_config.py `recompute_modules`, @d98e8a64), and its default.
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
TORCHTITAN_OP = "op"  # torchtitan's per-op selective checkpointing
RECOMPUTE_MODULES = (*MEGATRON_RECOMPUTE_MODULES, TORCHTITAN_OP)
NORMS = ("layer_norm", "rms_norm")
READERS = ("linear", "router")  # ops that save a norm's output as their input (an MoE router's F.linear too)


def _reads(op: Op) -> object:
    """The name of the tensor a Linear or router reads (a Linear's `input`, a router's `input_name`)."""
    return op.attrs.get("input") if op.kind == "linear" else op.attrs.get("input_name")
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "send_recv")


def recompute_of(config: object) -> tuple[str, tuple[str, ...]]:
    """(mode, modules) of a TrainConfig: `recompute` when given, else what `checkpointing` says (full or
    none); selective with no modules named recomputes Megatron's default, core attention."""
    mode = getattr(config, "recompute", None) or ("full" if getattr(config, "checkpointing", False) else "none")
    if mode != "selective":
        return mode, ()
    return mode, tuple(getattr(config, "recompute_modules", ()) or DEFAULT_RECOMPUTE_MODULES)


def _mark(op: Op, **attrs: object) -> Op:
    return Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | attrs)


def _keep(region: str, ops: Sequence[Op]) -> Op:
    """The checkpoint op of one recomputed region: what it keeps is its saved rule's (planner.memory.op_saved)."""
    return Op("checkpoint", f"{region}.checkpoint", {}, (), {}, {"region": region, "ops": tuple(ops)})


def op_policy_layer(ops: Sequence[Op]) -> list[Op]:
    """One layer under torchtitan's per-op policy: every op checkpointed; the odd-numbered bias-free Linears
    (aten.mm) and the fused attention kernels keep their outputs and are not run again; the rest is
    recomputed. The kept bytes are the `checkpoint` op's (region "op": the layer's input and those outputs)."""
    mm = 0
    saved: list[Op] = []
    marked = []
    for op in ops:
        keep = False
        if op.kind == "linear" and not op.attrs.get("bias"):
            mm += 1
            keep = mm % 2 == 1
        elif op.kind in ("attention_flash", "attention_efficient", "attention_cpu_flash"):
            keep = True  # SDPA's fused kernels (the CPU flash op where tests run on CPU)
        if keep:
            saved.append(op)
        marked.append(_mark(op, checkpointed=True, recomputed=not keep))
    keep_op = Op("checkpoint", "op.checkpoint", {}, (), {}, {"region": TORCHTITAN_OP, "ops": tuple(saved),
                                                            "input": ops[0] if ops else None})
    return [keep_op, *marked]


def selective_layer(ops: Sequence[Op], modules: Collection[str]) -> list[Op]:
    """One transformer layer's ops with the `modules` (Megatron's names, or torchtitan's "op") recomputed."""
    if TORCHTITAN_OP in modules:
        return op_policy_layer(ops)
    out = list(ops)
    marks: dict[int, dict[str, object]] = {}
    keeps: dict[int, Op] = {}  # index of a region's first op -> its checkpoint op
    if "core_attn" in modules:  # the attention kernel: softmax, dropout, P·V (Megatron's core_attention)
        for i, op in enumerate(out):
            if op.kind.startswith("attention_") and op.kind != "attention_mask":
                marks[i] = {"checkpointed": True, "recomputed": True}
                keeps[i] = _keep("core_attn", [op])
    if "mlp" in modules:  # the dense MLP module, its SP all-gather and reduction included
        idx = [i for i, op in enumerate(out) if op.attrs.get("megatron_module") == "mlp"]
        if idx:
            for i in idx:
                marks[i] = {"checkpointed": True, "recomputed": True}
            keeps[idx[0]] = _keep("mlp", [out[i] for i in idx])
    if "layernorm" in modules:  # norms whose output the next Linears save (pre-norm layers; BERT's first)
        for i, op in enumerate(out):
            if op.kind not in NORMS:
                continue
            nxt = next((j for j in range(i + 1, len(out)) if out[j].kind not in COLLECTIVES), None)
            if nxt is None or out[nxt].kind not in READERS:
                continue  # its output leaves the layer (a post-norm layer's last norm): nothing to discard
            reads = _reads(out[nxt])  # the Linears (and an MoE router) reading the norm's output share its name
            consumers = [j for j in range(nxt, len(out)) if out[j].kind in READERS and _reads(out[j]) == reads]
            if not consumers:
                continue  # its output leaves the layer (a post-norm layer's last norm): nothing to discard
            marks[i] = {"checkpointed": True, "recomputed": True}
            keeps[i] = _keep("layernorm", [op])
            for j in consumers:
                marks[j] = marks.get(j, {}) | {"input_discarded": True}
    moe = "moe" in modules
    for region, flag in (("moe", "moe_block"), ("shared_experts", "shared_experts"), ("moe_act", "moe_act")):
        if region not in modules or (moe and region != "moe"):
            continue  # "moe" recomputes the whole block, its shared expert and activation with it
        idx = [i for i, op in enumerate(out) if op.attrs.get(flag)]
        if not idx:
            continue  # a dense layer, or a block without a shared expert
        for i in idx:
            marks[i] = marks.get(i, {}) | {"checkpointed": True, "recomputed": True}
        keeps[idx[0]] = _keep(region, [out[i] for i in idx])
        if region == "moe_act":  # CheckpointWithoutOutput: fc2's saved input (the activation output) is freed
            down = next((j for j in range(idx[-1] + 1, len(out)) if out[j].kind == "expert_gemm"), None)
            if down is not None:
                marks[down] = marks.get(down, {}) | {"input_discarded": True}
    result = []
    for i, op in enumerate(out):
        if i in keeps:
            result.append(keeps[i])
        result.append(_mark(op, **marks[i]) if i in marks else op)
    return result


def recompute_selected(program: Program, modules: Collection[str]) -> Program:
    """`program` with the `modules` of every layer block recomputed (`selective_layer`)."""
    return Program(tuple(ProgramBlock(b.name, b.role, tuple(selective_layer(b.ops, modules)))
                         if b.role == "layer" else b for b in program.blocks))


def checkpoint_layers(program: Program, specs: dict[str, object]) -> Program:
    """`program` with every layer block checkpointed. `specs`: block name -> its TransformerSpec (the
    checkpoint op's saved rule reads the hidden size and whether the mask is passed positionally)."""
    blocks = []
    for b in program.blocks:
        if b.role != "layer":
            blocks.append(b)
            continue
        spec = specs[b.name]
        index = int(b.name.rsplit(".", 1)[-1])
        skip = family(spec.family).early_stop_skips_mlp_out  # type: ignore[attr-defined]
        ops = [Op(op.kind, op.name, op.shapes, op.params, op.dtypes,
                  op.attrs | {"checkpointed": True,
                              "recomputed": not (skip and op.name.endswith(("down_proj", "mlp.residual_add")))})
               for op in b.ops]
        keep = Op("checkpoint", "checkpoint", {}, (), {}, {"spec": spec, "index": index})
        blocks.append(ProgramBlock(b.name, b.role, (keep, *ops)))
    return Program(tuple(blocks))


# torch.compile (issue 35). Inductor fuses chains of pointwise ops into one generated kernel, and AOTAutograd's
# default partitioner for Inductor, `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py),
# chooses what the forward saves by a min cut over bytes in which pointwise ops may be recomputed in the
# backward (`is_fusible`, the `ban_recomputation` rules: matmuls, SDPA and other non-fusible "compute
# intensive" ops are never recomputed, `aten.mm`/`_scaled_dot_product_*` sit in `compute_intensive_ops`), so
# only the inputs of non-fusible ops, and the cheapest cut of each pointwise chain, stay saved. Per op kind:
# - linear, attention_*, embedding, index, cross_entropy: unchanged (matmuls and SDPA are not recomputed; their
#   saved inputs/outputs are what the eager autograd saves);
# - rms_norm: recomputed in backward from the fp32 rstd (n rows) and its input: the block's first norm saves the
#   block input in its dtype; a norm after a residual add saves the branch's last matmul output (16-bit, n·h),
#   from which with the block input the add is recomputed; never the fp32 upcast nor the normalised copy;
# - linear under autocast: the Linears reading one input share one 16-bit cast (the joint graph's CSE merges
#   identical casts; eager casts once per Linear); weight casts are saved as in eager;
#   (all measured: tests/test_fp8_compile.py, a Llama layer under aot_function with the min-cut partitioner,
#   bf16 and autocast, equal to the byte);
# - gated_mul: act(gate) is recomputed from the gate (which the activation saves): only `up` is saved;
# - activation, residual_add, rotary, dropout, tanh: pointwise, fused; their saved tensors as eager;
# - kernels: each run of consecutive fused ops becomes one kernel (one launch; it reads the chain's inputs and
#   writes its last output), Inductor's pointwise fusion (torch/_inductor/scheduler.py `can_fuse`).
# `activation_memory_budget` (torch._functorch.config, default 1.0) is left at its default: below 1 the
# partitioner recomputes more, which is not modelled.
FUSIBLE_KINDS = frozenset({"rms_norm", "activation", "gated_mul", "residual_add", "rotary", "dropout", "tanh"})


def compile_ops(ops: list[Op] | tuple[Op, ...]) -> list[Op]:
    """The ops with `fused` set on the pointwise ones (FUSIBLE_KINDS), as torch.compile runs them; a block's
    first op, when a norm, is marked `block_input` (it reads the block's input, which the partitioner saves;
    a later norm is recomputed from the block input and its branch's last matmul output)."""
    out = []
    for i, op in enumerate(ops):
        if op.kind in FUSIBLE_KINDS:
            extra = {"fused": True} | ({"block_input": True} if i == 0 else {})
            op = Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | extra)
        out.append(op)
    return out


def compile_program(program: Program) -> Program:
    """`program` under torch.compile (`compile_ops` on every block)."""
    return Program(tuple(ProgramBlock(b.name, b.role, tuple(compile_ops(b.ops))) for b in program.blocks))


# FP8 tensor cores need both GEMM dimensions of a weight divisible by 16: torchtitan converts only such Linears
# (torchtitan/components/quantization/utils.py @03a13843 `module_filter_fn`: "All dims must be divisible by 16
# due to float8 tensorcore hardware requirements"), and so does the probe job (jobs/fp8_linears.py).
FP8_ALIGN = 16


def fp8_ops(ops: list[Op] | tuple[Op, ...], recipe: str, experts: bool = False) -> list[Op]:
    """A transformer layer's ops with its nn.Linear ops marked FP8 (`fp8`: the recipe; planner.ir.fp8). Only
    layer blocks are passed: the LM head stays 16-bit (torchtitan's float8 `filter_fqns` default ["output"]),
    embeddings and norms are not Linears; a Linear whose weight has a dimension not divisible by 16 (Qwen2-MoE's
    shared-expert gate, h × 1) stays 16-bit too (`FP8_ALIGN`). `experts`: the routed experts' grouped GEMMs too
    (Megatron-Core's TEGroupedMLP is TE's GroupedLinear, inside the same fp8_autocast as every TE module:
    megatron/core/transformer/moe/experts.py @d98e8a64; transformers' grouped_mm and torchtitan's default
    float8 converter, which swaps nn.Linear only, leave them 16-bit)."""
    kinds = ("linear", "expert_gemm") if experts else ("linear",)
    return [Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | {"fp8": recipe})
            if op.kind in kinds and "block" not in op.attrs and _fp8_aligned(op) else op for op in ops]


def _fp8_aligned(op: Op) -> bool:
    weights = [p.shape for p in op.params if p.name.endswith("weight") and len(p.shape) == 2]
    return all(d % FP8_ALIGN == 0 for shape in weights for d in shape)


def fp8_experts(ctx: object) -> bool:
    """Whether the routed experts' GEMMs run in FP8: a Transformer Engine recipe in a framework whose own MoE
    runs the experts (`experts_16bit`: Megatron-Core's TEGroupedMLP)."""
    from planner.ir.fp8 import TRANSFORMER_ENGINE

    return getattr(ctx, "fp8", None) in TRANSFORMER_ENGINE and bool(getattr(ctx, "experts_16bit", False))


def fp8_program(program: Program, recipe: str) -> Program:
    """`program` with the layer blocks' Linears in FP8 (`fp8_ops`)."""
    return Program(tuple(ProgramBlock(b.name, b.role, tuple(fp8_ops(b.ops, recipe) if b.role == "layer" else b.ops))
                         for b in program.blocks))


def for_context(ops: list[Op] | tuple[Op, ...], ctx: object, role: str) -> list[Op]:
    """The transforms a context record asks for, on one block's ops of role `role`: FP8 Linears in layers
    (ctx.fp8) and torch.compile (ctx.compile)."""
    out = list(ops)
    if getattr(ctx, "fp8", None) and role == "layer":
        out = fp8_ops(out, ctx.fp8, fp8_experts(ctx))  # type: ignore[attr-defined]
    if getattr(ctx, "compile", False):
        out = compile_ops(out)
    return out


# ------------------------------------------------------------------------------------------ LoRA / QLoRA


@dataclass(frozen=True)
class Adapters:
    """What the LoRA / QLoRA transform reads of a run: plain data (built from planner.adapters.lora's plan by
    `planner.adapters.activations.adapters_of`), so this layer reads nothing above it. Module names are
    `named_modules()` names, the parameter names of the program without ".weight"."""

    r: int
    dropout: float  # lora_dropout
    scaling: float  # lora_alpha / r
    adapted: frozenset[str]  # modules that get lora_A / lora_B
    quantized: frozenset[str]  # modules stored 4-bit (bitsandbytes Linear4bit)
    trained: frozenset[str]  # modules trained in full (peft's SEQ_CLS modules_to_save)
    first: str | None  # the first block with an adapter (None: none)
    input_grads: bool  # the embeddings' output requires grad (`enable_input_require_grads`)
    base_low: bool  # the base is stored in autocast's 16-bit dtype: autocast casts no base weight
    dequant_bytes: int = 2  # bytes per element of a 4-bit weight dequantized (bnb_4bit_compute_dtype)
    experts: frozenset[str] = frozenset()  # fused expert weights with an adapter (peft target_parameters)


# Blocks of a transformer the transform rewrites; the multimodal model's dense / batch-norm blocks and the loss
# run as in full training.
LORA_ROLES = frozenset({"embeddings", "layer", "final_norm", "pooler", "head"})


def module_of(op: Op) -> str | None:
    """The module an op's parameters belong to (its weight's name less ".weight"; a tied weight: its bias's;
    an adapted Linear's, whose parameters peft moves under `base_layer`: its `module` attr)."""
    if "module" in op.attrs:
        return op.attrs["module"]
    for suffix in (".weight", ".bias"):
        for p in op.params:
            if p.name.endswith(suffix):
                return p.name[: -len(suffix)]
    return None


def lora_layers(program: Program, adapters: Adapters, ctx: Ctx) -> Program:
    """`program` as a LoRA / QLoRA run executes it (peft tuners/lora/layer.py `Linear.forward`:
    `result = base_layer(x); x = _cast_input_dtype(x, lora_A.weight.dtype);
    result = result + lora_B(lora_A(dropout(x))) * scaling`; bitsandbytes `Linear4bit` for a 4-bit base).

    What changes, op by op (each a fact of autograd: a tensor is saved only for a gradient that is needed):
    - every base parameter is frozen (`frozen`): a frozen Linear saves no input (derivatives.yaml `mm` saves
      `self` only for `mat2`'s gradient), nor does the attention op the output projection's context, nor
      `first_token` the pooler's input, nor an `index` op the ids of a frozen table; an RMSNorm drops the
      normalized tensor kept for its weight's gradient; a module trained in full (a SEQ_CLS head) is as in
      full training;
    - a Linear whose input needs no gradient saves no AMP weight cast (`input_grad` False): the layer input of
      the first adapted layer (unless the embeddings' output requires grad), and its input norm saves nothing;
      every op of the blocks before it saves nothing (`no_grad`);
    - each adapted Linear is followed by its adapter: `dropout` (p > 0, on the fp32 copy of x), `lora_A`,
      `lora_B` (fp32 parameters named `<module>.lora_A.default.weight` as peft names them inside the
      PeftModel's base_model.model), and the `scale` op that adds lora_B's output times `scaling`;
    - a 4-bit Linear reads a `dequantize` op (the weight in the compute dtype, freed after the matmul, so a
      transient) and casts no weight; under AMP it returns its input's dtype, so a gated MLP's gate, up and
      activation outputs stay fp32 (bitsandbytes nn/modules.py `Linear4bit.forward`);
    - a base stored in autocast's dtype casts no weight, and Llama's rotary tables come in that dtype.
    The memory interpreter reads the result (planner.adapters.activations); tests/test_lora_activations.py
    compares it with real peft modules' saved-tensor hooks.
    """
    order = {b.name: i for i, b in enumerate(program.blocks)}
    first = order.get(adapters.first, len(program.blocks)) if adapters.first is not None else None
    return Program(tuple(lora_program_block(b, i, first, adapters, ctx) for i, b in enumerate(program.blocks)))


def lora_program_block(b: ProgramBlock, i: int, first: int | None, adapters: Adapters, ctx: Ctx) -> ProgramBlock:
    """Block `b`, the `i`-th of its program, under `adapters` (`lora_layers`); `first`: the index of the first
    block with an adapter (None: none). One block at a time, so the memory model transforms only the layers
    that differ (planner.adapters.activations)."""
    if b.role not in LORA_ROLES or b.ops and "block" in b.ops[0].attrs:
        return b
    before = first is None or (i < first and not adapters.input_grads)
    if before or (b.role == "embeddings" and not adapters.input_grads):
        ops = []
        for op in b.ops:  # nothing needs a gradient here; a 4-bit weight is still dequantized
            if op.kind == "linear" and module_of(op) in adapters.quantized:
                ops.append(_with(_dequantize(op, adapters, ctx), no_grad=True))
            ops.append(_with(op, no_grad=True))
        return ProgramBlock(b.name, b.role, tuple(ops))
    return ProgramBlock(b.name, b.role, tuple(lora_block(b, adapters, ctx,
                                                         first_grad=i == first and not adapters.input_grads)))


def _with(op: Op, **attrs: object) -> Op:
    return Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | attrs)


def lora_block(block: ProgramBlock, adapters: Adapters, ctx: Ctx, first_grad: bool = False) -> list[Op]:
    """One block's ops under `adapters` (see `lora_layers`). `first_grad`: the block is the first adapted one
    and its input needs no gradient."""
    ops = block.ops
    modules = {id(op): module_of(op) for op in ops if op.kind == "linear"}
    trained = {i: modules[i] in adapters.trained for i in modules}
    by_name = {op.name: op for op in ops if op.kind == "linear"}
    # a group: the Linears reading one saved input; under fp32 without dropout lora_A saves x itself, once
    takers: dict[str, list[str]] = {}
    for op in ops:
        if op.kind == "linear" and modules[id(op)] in adapters.adapted:
            takers.setdefault(_group(op, ops), []).append(op.name)
    mlp_linears = [op for op in ops if op.kind == "linear" and op.attrs["input"] == "mlp.input"]
    four_bit_mlp = ctx.amp and any(op.kind == "gated_mul" for op in ops) and bool(mlp_linears) and all(
        modules[id(op)] in adapters.quantized for op in mlp_linears)
    out: list[Op] = []
    for k, op in enumerate(ops):
        if op.kind == "linear":
            m = modules[id(op)]
            grad = not (first_grad and op.attrs.get("attention_input"))
            if m in adapters.quantized:
                out.append(_dequantize(op, adapters, ctx))
            if trained[id(op)]:  # a 16-bit base's trained copy is 16-bit too: autocast casts nothing
                out.append(_with(op, casts_weight=False) if adapters.base_low else op)
                continue
            casts = grad and m not in adapters.quantized and not adapters.base_low
            if m in adapters.adapted:  # peft's lora.Linear wraps the module: its parameters under `base_layer`
                base = tuple(Param(f"{m}.base_layer.{p.name[len(m) + 1:]}" if p.name.startswith(f"{m}.") else p.name,
                                   p.shape) for p in op.params)
                out.append(Op(op.kind, op.name, op.shapes, base, op.dtypes, op.attrs | {
                    "frozen": True, "input_grad": grad, "casts_weight": casts, "module": m}))
                out += adapter_ops(op, m, ops, takers, adapters, ctx, grad)
            else:
                out.append(_with(op, frozen=True, input_grad=grad, casts_weight=casts))
        elif op.kind.startswith("attention_"):
            proj = next((o for o in ops[k + 1:] if o.kind == "linear"), None)
            frozen = proj is not None and not proj.attrs["saves_input"] and not trained[id(proj)]
            out.append(_with(op, context_frozen=True) if frozen else op)
        elif op.kind == "first_token":
            reader = by_name.get(op.attrs["consumer"])
            out.append(op if reader is not None and trained[id(reader)] else _with(op, no_grad=True))
        elif op.kind == "router":
            out.append(_with(op, frozen=True))  # a frozen router weight: F.linear keeps no input for it
        elif op.kind == "permute" and op.attrs.get("bias_index"):
            out.append(_with(op, frozen_bias=True))  # frozen expert biases: their gather keeps no indices
        elif op.kind == "expert_gemm":
            out.append(_expert_gemm(op, ops, adapters, ctx))
        elif op.kind == "index":
            out.append(_with(op, no_grad=True))  # the ids of a frozen table: nothing needs them
        elif op.kind in ("rms_norm", "layer_norm") and first_grad and k == 0:
            out.append(_with(op, no_grad=True))  # the first adapted layer's input norm: no gradient reaches it
        elif op.kind == "rms_norm":
            out.append(_with(op, frozen=True))
        elif op.kind == "rotary" and adapters.base_low:
            out.append(Op(op.kind, op.name, op.shapes, op.params, op.dtypes | {"tables": ctx.low}, op.attrs))
        elif four_bit_mlp and op.kind == "activation":
            x = by_name[next(o.name for o in ops if o.kind == "linear" and o.attrs["input"] == "mlp.input")]
            dt = x.dtypes["input"]
            out.append(Op(op.kind, op.name, op.shapes, op.params, op.dtypes | {"input": dt, "output": dt}, op.attrs))
        elif four_bit_mlp and op.kind == "gated_mul":
            x = next(o for o in ops if o.kind == "linear" and o.attrs["input"] == "mlp.input")
            dt = x.dtypes["input"]
            out.append(Op(op.kind, op.name, op.shapes, op.params,
                          op.dtypes | {"input": dt, "other": dt, "output": dt}, op.attrs))
        else:
            out.append(op)
    return out


def _expert_gemm(op: Op, ops: tuple[Op, ...], adapters: Adapters, ctx: Ctx) -> Op:
    """A grouped expert GEMM under LoRA. Frozen experts: the weight needs no gradient, so grouped_mm keeps no
    input. Adapted ones (peft 0.21 ParamWrapper, `target_parameters`): while the layer runs, the weight is a
    parametrization, `_LoraFactorsProxy.forward` = `baddbmm(W, lhs, rhs, alpha=scaling)` with autocast off, so
    the experts compute with a merged copy W' of the whole local stack in W's dtype; W' needs a gradient, so
    grouped_mm keeps its input (as full training does) and W' itself (`merged`), and baddbmm keeps lhs and rhs,
    the adapters' factors, which are views of the fp32 adapters unless W is 16-bit (`.to(param.dtype)`: new
    16-bit copies, `factor_cast`). The parameters are renamed as peft nests its wrappers (each adapted weight
    of a module wraps the module once more, in registration order: `experts.base_layer.base_layer.gate_up_proj`,
    `experts.base_layer.lora_A.default.weight` for gate_up, `experts.lora_A.default.weight` for down)."""
    weight = op.params[0]
    module = weight.name.rsplit(".", 1)[0]
    siblings = [o.params[0].name for o in ops if o.kind == "expert_gemm" and o.params[0].name.rsplit(".", 1)[0] == module]
    adapted = [n for n in siblings if n in adapters.experts]
    if weight.name not in adapters.experts:
        params = op.params if not adapted else tuple(
            Param(f"{module}.{'base_layer.' * len(adapted)}{p.name[len(module) + 1:]}", p.shape) for p in op.params)
        return Op(op.kind, op.name, op.shapes, params, op.dtypes, op.attrs | {"frozen": True})
    depth = len(adapted) - adapted.index(weight.name) - 1  # the first registered is wrapped innermost
    experts, n_in, n_out, r = weight.shape[0], op.shapes["input"][1], op.shapes["output"][1], adapters.r
    lora = f"{module}.{'base_layer.' * depth}"
    params = tuple(Param(f"{module}.{'base_layer.' * len(adapted)}{p.name[len(module) + 1:]}", p.shape)
                   for p in op.params)
    params += (Param(f"{lora}lora_A.default.weight", (r * experts, n_in)),
               Param(f"{lora}lora_B.default.weight", (n_out, r * experts)))
    local = op.shapes["experts"][0]
    return Op(op.kind, op.name, op.shapes, params, op.dtypes, op.attrs | {
        "merged": local * n_in * n_out, "factor_cast": local * r * (n_in + n_out) if op.dtypes["compute"] != F32
        else 0})


def _dequantize(op: Op, adapters: Adapters, ctx: Ctx) -> Op:
    """The dequantization a 4-bit Linear runs before its matmul (and again in backward)."""
    w = op.shapes["input"][1] * op.shapes["output"][1]
    return Op("dequantize", f"{op.name}.dequantize", {"input": (w,), "output": (w,)}, (),
              {"input": "nf4", "output": ctx.low}, {"bytes_per_element": adapters.dequant_bytes})


def _group(op: Op, ops: tuple[Op, ...]) -> str:
    """The saved input a Linear shares with the other Linears reading the same tensor (its `input` attr); the
    output projection's, which the attention op saves, is the attention's context."""
    return op.attrs["input"] if op.attrs["saves_input"] else f"{op.name}.input"


def _x_storage(op: Op, ops: tuple[Op, ...], ctx: Ctx) -> int | None:
    """Elements of the storage holding a Linear's input x where full training saves it (so lora_A, saving x
    itself, keeps that storage); None where no op saves it (a fused attention's output, kept by the kernel)."""
    rows, n_in = op.shapes["input"]
    if op.attrs["saves_input"]:
        return rows * n_in
    k = ops.index(op)
    prev = next((o for o in reversed(ops[:k]) if o.kind.startswith("attention_")), None)
    if prev is not None and prev.kind in ("attention_eager", "attention_math") \
            and next(o for o in ops[ops.index(prev) + 1:] if o.kind == "linear") is op:
        return rows * n_in  # the eager / math paths' contiguous context copy
    tok = next((o for o in ops if o.kind == "first_token" and o.attrs["consumer"] == op.name), None)
    if tok is not None:
        return rows * n_in if ctx.amp else math.prod(tok.shapes["input"])  # x is a view of the hidden state
    return None


def adapter_ops(op: Op, module: str, ops: tuple[Op, ...], takers: dict[str, list[str]], adapters: Adapters,
                ctx: Ctx, grad: bool) -> list[Op]:
    """dropout -> lora_A -> lora_B -> scale-and-add of one adapted Linear (peft lora.Linear.forward). Adapters
    are fp32 (autocast_adapter_dtype); x is cast to fp32 first, so under autocast lora_A saves a 16-bit cast of
    it, without autocast a new fp32 copy of a 16-bit x, or x itself (one storage for every adapter reading it)."""
    rows, n_in = op.shapes["input"]
    n_out, r = op.shapes["output"][1], adapters.r
    low = ctx.low if ctx.amp else F32
    src = op.dtypes["input"]
    out: list[Op] = []
    a_input: dict[str, object] = {"input": f"{op.name}.lora_A.input", "consumers": 1, "consumer": 0,
                                  "saves_input": True}
    if adapters.dropout > 0:
        out.append(Op("dropout", f"{op.name}.lora_dropout", {"input": (rows * n_in,), "output": (rows * n_in,)}, (),
                      {"input": F32, "output": F32},
                      {"p": adapters.dropout, "adapter": True} | ({} if grad else {"no_grad": True})))
    elif not ctx.amp and src == F32:
        group = _group(op, ops)
        storage = _x_storage(op, ops, ctx)
        a_input = {"input": group, "consumers": len(takers[group]), "consumer": takers[group].index(op.name),
                   "saves_input": storage is not None, "saved_numel": storage or 0}
    out.append(Op("linear", f"{op.name}.lora_A", {"input": (rows, n_in), "output": (rows, r)},
                  (Param(f"{module}.lora_A.default.weight", (r, n_in)),), {"input": F32, "compute": low, "output": low},
                  a_input | {"bias": False, "casts_weight": grad, "adapter": True}))
    out.append(Op("linear", f"{op.name}.lora_B", {"input": (rows, r), "output": (rows, n_out)},
                  (Param(f"{module}.lora_B.default.weight", (n_out, r)),), {"input": low, "compute": low, "output": low},
                  {"input": f"{op.name}.lora_B.input", "consumers": 1, "consumer": 0, "saves_input": True,
                   "as_is": True, "bias": False, "adapter": True}))
    out.append(Op("scale", f"{op.name}.lora_scale", {"input": (rows * n_out,), "output": (rows * n_out,)}, (),
                  {"input": low, "other": op.dtypes["output"], "output": op.dtypes["output"]},
                  {"scaling": adapters.scaling, "adapter": True}))
    return out

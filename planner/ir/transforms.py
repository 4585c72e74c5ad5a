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
saved, is freed after the forward and rebuilt in backward (the Linears' `input_discarded`). Names of modules a
dense model does not have (moe_act, moe, shared_experts, mla_up_proj) select nothing.

torchtitan's per-op policy ("op", `--recompute-modules op`; torchtitan/models/llama3/infra/parallelize.py
`_save_list` and `apply_ac` with selective_ac_option "op"): the whole layer is checkpointed with
torch.utils.checkpoint's selective policy, which keeps the outputs of every other `aten.mm` (the 1st, 3rd,
...: a Linear without bias; one with a bias runs addmm, which the list lacks) and of the fused SDPA kernels
(flash, memory-efficient), and recomputes every other op in backward (`op_policy_layer`).

Tensor-parallel sharding is not a transform: the layer forms emit one rank's ops from the context record
(planner.ir.context.Ctx tp, sp, cp), because which ops run (the collectives, the SP all-gathers) and their
shapes are the form's business exactly as the attention kernel and the autocast dtypes are; a transform that
rewrote shapes afterwards would have to re-derive every width the form already knows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from planner.families import family
from planner.ir.ops import Op, Program, ProgramBlock

# Megatron-Core's module names (transformer_config.py `recompute_modules`, @d98e8a64), and its default.
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
TORCHTITAN_OP = "op"  # torchtitan's per-op selective checkpointing
RECOMPUTE_MODULES = (*MEGATRON_RECOMPUTE_MODULES, TORCHTITAN_OP)
NORMS = ("layer_norm", "rms_norm")
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
        idx = [i for i, op in enumerate(out) if op.attrs.get("module") == "mlp"]
        if idx:
            for i in idx:
                marks[i] = {"checkpointed": True, "recomputed": True}
            keeps[idx[0]] = _keep("mlp", [out[i] for i in idx])
    if "layernorm" in modules:  # norms whose output the next Linears save (pre-norm layers; BERT's first)
        for i, op in enumerate(out):
            if op.kind not in NORMS:
                continue
            nxt = next((j for j in range(i + 1, len(out)) if out[j].kind not in COLLECTIVES), None)
            if nxt is None or out[nxt].kind != "linear":
                continue  # its output leaves the layer (a post-norm layer's last norm): nothing to discard
            reads = out[nxt].attrs.get("input")  # the Linears reading the norm's output share its name
            consumers = [j for j in range(nxt, len(out)) if out[j].kind == "linear" and out[j].attrs.get("input") == reads]
            if not consumers:
                continue  # its output leaves the layer (a post-norm layer's last norm): nothing to discard
            marks[i] = {"checkpointed": True, "recomputed": True}
            keeps[i] = _keep("layernorm", [op])
            for j in consumers:
                marks[j] = marks.get(j, {}) | {"input_discarded": True}
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


def fp8_ops(ops: list[Op] | tuple[Op, ...], recipe: str) -> list[Op]:
    """A transformer layer's ops with its nn.Linear ops marked FP8 (`fp8`: the recipe; planner.ir.fp8). Only
    layer blocks are passed: the LM head stays 16-bit (torchtitan's float8 `filter_fqns` default ["output"]),
    embeddings and norms are not Linears."""
    return [Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | {"fp8": recipe})
            if op.kind == "linear" and "block" not in op.attrs else op for op in ops]


def fp8_program(program: Program, recipe: str) -> Program:
    """`program` with the layer blocks' Linears in FP8 (`fp8_ops`)."""
    return Program(tuple(ProgramBlock(b.name, b.role, tuple(fp8_ops(b.ops, recipe) if b.role == "layer" else b.ops))
                         for b in program.blocks))


def for_context(ops: list[Op] | tuple[Op, ...], ctx: object, role: str) -> list[Op]:
    """The transforms a context record asks for, on one block's ops of role `role`: FP8 Linears in layers
    (ctx.fp8) and torch.compile (ctx.compile)."""
    out = list(ops)
    if getattr(ctx, "fp8", None) and role == "layer":
        out = fp8_ops(out, ctx.fp8)  # type: ignore[attr-defined]
    if getattr(ctx, "compile", False):
        out = compile_ops(out)
    return out

"""Transforms: functions from a program to a program.

Activation checkpointing (transformers' gradient checkpointing, torch.utils.checkpoint non-reentrant): each
transformer layer keeps only its inputs (a `checkpoint` op at its start) and its ops are marked
`recomputed`: they save nothing during the forward and run again in backward (torch/utils/checkpoint.py
`_checkpoint_without_reentrant_generator`; early stop, on by default, skips the trailing ops whose outputs
nothing saves: Llama's down projection and residual add are not `recomputed`).
LoRA / QLoRA, tensor-parallel sharding and FP8 copies are the next transforms to move here (issue 33).
"""

from __future__ import annotations

from planner.families import family
from planner.ir.ops import Op, Program, ProgramBlock


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

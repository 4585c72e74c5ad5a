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

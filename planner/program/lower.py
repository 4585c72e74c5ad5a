"""The traced front end's program: a trace (planner.program.records.StepTrace) lowered to the blocks and ops
of planner.ir.ops, the record the hand-modelled families' programs have (issue 33 item 2).

Why: `planner estimate --json`'s `program.blocks[]` and the per-block memory are then assembled in one place
for both front ends (planner.pipeline.program_report reads a Program whichever front end made it), and the
interpreters read a traced op by the same registries (kind "aten": planner.memory.op_saved,
planner.perf.op_rules).

Each ATen op of the step (forward, backward and checkpoint recomputation; not the optimizer's) becomes one
op of the block it ran for (`StepTrace.op_blocks`), in execution order, with the storages it allocated that
the forward saves for backward (`SavedRecord`, allocator-rounded on the device: one `Saved` of that many
bytes), its FLOPs (flop_counter's formula) and its kernel (planner.program.speed's rule). A saved storage
that no op of its block allocated (a batch tensor's view, a storage made before the block) goes on the
block's first op. The tracer counts a block's parameters, not their tensors, so a traced op names none.
"""

from __future__ import annotations

from collections import defaultdict

from planner.ir.ops import Op, Program, ProgramBlock
from planner.memory.activations import Saved
from planner.program import speed
from planner.program.records import LOSS_BLOCK, StepTrace

_PHASES = ("forward", "backward")


def traced_program(trace: StepTrace, order: tuple[str, ...] = (), retained: dict[str, int] | None = None
                   ) -> Program:
    """Every block of `trace` (in `order`, the step memory's block order, then any other) as a ProgramBlock
    of "aten" ops; see the module docstring.

    `retained`: block -> bytes of its outputs the training loop keeps, as the step memory counts them (the
    full forward's; planner.pipeline.step `_prepare_traced`). Under checkpointing the traced step may save a
    block's output that the full forward returns to the loop (BART's encoder output, which the decoder's
    checkpoints keep): the step counts that storage once, as retained, so it is not a saved storage here
    either (the block's last saved storages, up to the bytes the checkpointed trace does not retain)."""
    producer = {e.storage: e.op for e in trace.events if e.action == "alloc"}
    saved_at: dict[int, list[Saved]] = defaultdict(list)  # op index -> storages it allocated that are saved
    loose: dict[str, list[Saved]] = defaultdict(list)  # block -> saved storages no op of the block made
    blocks_of = trace.op_blocks
    by_index = {rec.index: rec for rec in trace.ops}
    for s in trace.saved:
        t = Saved(s.module or s.block, s.device_bytes, "uint8")
        p = producer.get(s.storage, -1)
        made = by_index.get(p)
        if made is not None and made.phase == "forward" and p < len(blocks_of) and (blocks_of[p] or LOSS_BLOCK) == s.block:
            saved_at[p].append(t)
        else:
            loose[s.block].append(t)
    ops: dict[str, list[Op]] = defaultdict(list)
    for rec in trace.ops:
        if rec.phase not in _PHASES:
            continue
        block = (blocks_of[rec.index] if rec.index < len(blocks_of) else "") or LOSS_BLOCK
        kind, dtype, _, flops, nbytes = speed.op_row(rec)
        shapes = {"input": rec.inputs[0].shape} if rec.inputs else {}
        if rec.outputs:
            shapes["output"] = rec.outputs[0].shape
        ops[block].append(Op("aten", rec.name, shapes, (), {"compute": dtype},
                             {"saved": tuple(saved_at.get(rec.index, ())), "flops": rec.flops, "bytes": int(nbytes),
                              "kernel": rec.kernel, "kernel_kind": kind, "phase": speed.op_phase(rec),
                              "module": rec.module}))
    own = {b.name: b.retained_bytes for b in trace.blocks}
    names = list(order) + [b.name for b in trace.blocks if b.name not in order]
    out = []
    for name in names:
        block_ops = ops.get(name, [])
        extra = tuple(loose.get(name, ()))
        if extra:
            if block_ops:
                first = block_ops[0]
                block_ops[0] = Op(first.kind, first.name, first.shapes, (), first.dtypes,
                                  first.attrs | {"saved": first.attrs["saved"] + extra})
            else:
                block_ops = [Op("aten", "(saved)", {}, (), {"compute": "float32"},
                                {"saved": extra, "flops": 0, "bytes": 0, "kernel": False, "kernel_kind": "memory_bound",
                                 "phase": "forward", "module": name})]
        _drop_outputs(block_ops, (retained or {}).get(name, 0) - own.get(name, 0))
        out.append(ProgramBlock(name, "traced", tuple(block_ops)))
    return Program(tuple(out))


def _drop_outputs(ops: list[Op], nbytes: int) -> None:
    """Take `nbytes` of saved storages off the block's ops, last saved first (a block's output is made last),
    in place; nothing when no run of last storages sums to exactly that."""
    if nbytes <= 0:
        return
    plan: list[tuple[int, int]] = []  # (op position, storages kept)
    left = nbytes
    for k in range(len(ops) - 1, -1, -1):
        saved = ops[k].attrs["saved"]
        keep = len(saved)
        while keep and saved[keep - 1].numel <= left:
            keep -= 1
            left -= saved[keep].numel
        if keep != len(saved):
            plan.append((k, keep))
        if left == 0 or keep:
            break
    if left:
        return
    for k, keep in plan:
        op = ops[k]
        ops[k] = Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | {"saved": op.attrs["saved"][:keep]})

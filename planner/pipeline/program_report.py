"""`program.blocks[]` of `planner estimate --json`: every block's ops with what each interpreter says of it.

Per op: `kind`, `name`, `shapes`, `params` (the parameter tensors' names, as `module.named_parameters()`
gives them), `param_bytes` (resident on one GPU: the precision's parameter dtype, divided under ZeRO-3/FSDP),
`saved_bytes` (what the op keeps for backward after the forward, allocator-rounded: its saved storages, and
under autocast its weight's 16-bit cast; under checkpointing a layer's inputs only, on its `checkpoint` op),
`transient_bytes` (the memory model's peak of the block's unsaved temporaries, the larger of forward and
backward, on the op that saves the block's largest tensor, which is what that peak is built from: see
`_transient_owner`; 0 on the block's other ops), `flops`
(forward + backward matmul FLOPs of one micro-step, FlopCounterMode's convention), `bytes_moved` and
`launches` (its CUDA kernels in forward, backward and recompute: planner.perf.op_rules over
planner.perf.kernels' primitives).

On one GPU without adapters the `param_bytes` sum to `memory_bytes.parameters` and the `saved_bytes` to
`memory_bytes.activations` (tests/test_program.py). Under LoRA/QLoRA the adapters are not ops yet (the LoRA
transform is still to move onto the program), so those sums differ there. A traced model has no program yet:
its blocks come from the tracer (`front_end` says which).
"""

from __future__ import annotations

import math
from typing import Any

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.ir.interpret import apply, load_rules
from planner.ir.ops import Op
from planner.ir.transforms import checkpoint_layers, recompute_of, recompute_selected
from planner.memory.activations import Saved, alloc_bytes
from planner.memory.model_states import parameter_dtype_bytes
from planner.memory.parallel import Sharding
from planner.models.blocks import model_blocks
from planner.perf import kernels as K
from planner.perf.flops import BACKWARD_TO_FORWARD
from planner.spec import ModelSpec, TrainConfig, TransformerSpec


def op_kernels(op: Op, ctx: Ctx) -> list[K.Kernel]:
    """Forward, backward and (checkpointed) recompute kernels of one op, with the autocast casts of its
    weight and bias (planner.perf.kernels' rules, op by op)."""
    fwd = apply("kernels", op, ctx)
    if op.kind == "embedding":
        n, h = op.shapes["output"]
        rows = op.shapes["table"][0]
        e = K.nbytes(op.dtypes["output"])
        bwd = [K.Kernel(f"{op.name}.backward", "memory_bound", 0, n * (h * e + 8), rows * h * e + n * h * e,
                        op.dtypes["output"], "backward")]
    else:
        bwd = [b for k in reversed(fwd) for b in K.backward_of(k)] + K.bias_grads(fwd)
    if op.kind == "first_token":
        rows, h = op.shapes["input"]
        e = K.nbytes(ctx.act)
        bwd.append(K.Kernel(f"{op.name}.backward", "memory_bound", 0, ctx.b * h * e, rows * h * e, ctx.act,
                            "backward", launches=2))
    casts: list[K.Kernel] = []
    if ctx.amp and op.kind in ("linear", "router"):
        rows, n_in = op.shapes["input"]
        n_out = op.shapes["output" if op.kind == "linear" else "logits"][1]
        for name, numel in (("weight", n_in * n_out), ("bias", n_out if op.attrs.get("bias") else 0)):
            if numel:
                casts.append(K.elementwise(f"{op.name}.{name}.cast", numel, ("float32",), (ctx.low,), ctx.low))
                casts.append(K._with(K.elementwise(f"{op.name}.{name}.grad_cast", numel, (ctx.low,), ("float32",),
                                                   "float32"), phase="backward"))
    again = [K._with(k, phase="recompute") for k in fwd] if op.attrs.get("recomputed") else []
    return casts + fwd + bwd + again


def _saved(op: Op, ctx: Ctx) -> list[Saved]:
    """What the op keeps after the forward: nothing inside a checkpointed layer; its saved storages and, under
    autocast, its weight's cast (a Linear's matmul saves the cast weight for backward)."""
    if op.attrs.get("checkpointed"):
        return []
    out = list(apply("saved", op, ctx))
    if ctx.amp and op.kind == "linear":
        rows, n_in = op.shapes["input"]
        out.append(Saved(f"{op.name}.weight.cast", n_in * op.shapes["output"][1], ctx.low))
    elif ctx.amp and op.kind == "router":  # F.linear(x, gate.weight): the same cast, E × h
        out.append(Saved(f"{op.name}.weight.cast", math.prod(op.params[0].shape), ctx.low))
    return out


def _transient_owner(ops: tuple[Op, ...], ctx: Ctx) -> int | None:
    """Index of the op a block's transients belong to: the first op saving the block's largest tensor
    (allocator-rounded). The memory model builds a block's forward peak from that tensor (its producer's
    output before the next op consumes it) and its backward peak from that tensor's gradient (a transformer
    layer's: the larger of the attention and MLP branches, each led by its largest saved tensor:
    activations.layer_backward_tensors). The inputs a checkpoint keeps set no peak. None: no op."""
    sizes = [max((alloc_bytes(t.nbytes, ctx.backend) for t in apply("saved", op, ctx)), default=0)
             if op.kind != "checkpoint" else -1 for op in ops]
    return sizes.index(max(sizes)) if sizes else None


def program_report(model: ModelSpec, config: TrainConfig, share: Sharding, ctx: Ctx) -> dict[str, Any]:
    """The program of `model` under the resolved `config` and its context record `ctx`
    (planner.pipeline.resolve.context: the record the memory and speed interpreters read), as JSON."""
    from planner.memory.activations import activation_blocks

    load_rules()
    # the memory model's per-block transients (forward, backward) under the same record
    peaks = {a.block: max(a.forward_transient_bytes, a.backward_transient_bytes)
             for a in activation_blocks(model, config, ctx=ctx)}
    program = model_program(model, ctx)
    mode, modules = recompute_of(config)
    if mode == "full":
        specs = {b.name: b.layer for b in model_blocks(model) if isinstance(b.layer, TransformerSpec)}
        program = checkpoint_layers(program, specs)
    elif mode == "selective":
        program = recompute_selected(program, modules)
    p_bytes = parameter_dtype_bytes(config.precision)
    blocks = []
    for block in program.blocks:
        ops = []
        owner = _transient_owner(block.ops, ctx)
        for i, op in enumerate(block.ops):
            kernels = op_kernels(op, ctx)
            full = sum(p.numel for p in op.params) * p_bytes
            ops.append({
                "kind": op.kind, "name": op.name,
                "shapes": {k: list(v) for k, v in op.shapes.items()},
                "params": [p.name for p in op.params],
                "param_bytes": share.block_bytes(full, 0)[0],
                "saved_bytes": sum(alloc_bytes(t.nbytes, ctx.backend) for t in _saved(op, ctx)),
                "transient_bytes": peaks.get(block.name, 0) if i == owner else 0,
                "flops": apply("flops", op, ctx) * (1 + BACKWARD_TO_FORWARD),
                "bytes_moved": sum(k.bytes * k.count for k in kernels),
                "launches": sum(k.launches * k.count for k in kernels),
            })
        blocks.append({"name": block.name, "ops": ops})
    return {"front_end": "analytic", "blocks": blocks}

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

Under LoRA / QLoRA the program is the LoRA transform's (planner.ir.transforms.lora_layers: adapter ops,
frozen parameters, 4-bit weights dequantized), the one the memory model reads (planner.adapters.activations);
`param_bytes` are stored as planner.adapters.lora stores them. On one GPU the `param_bytes` sum to
`memory_bytes.parameters` and the `saved_bytes` to `memory_bytes.activations`, with or without adapters
(tests/test_program.py). A traced model has no program yet: its blocks come from the tracer (`front_end`
says which).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.ir.interpret import apply, load_rules
from planner.ir.ops import Op, Program, weight_matmul
from planner.ir.transforms import checkpoint_layers, recompute_of, recompute_selected
from planner.memory.activations import Saved, alloc_bytes
from planner.memory.model_states import parameter_dtype_bytes
from planner.memory.op_saved import op_saved, weight_cast
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
    elif op.kind == "dequantize":  # the backward dequantizes the weight again for the input's gradient
        bwd = [K._with(k, name=f"{k.name}.backward", phase="backward") for k in fwd]
    else:
        bwd = [b for k in reversed(fwd) for b in K.backward_of(k)] + K.bias_grads(fwd)
    if op.kind == "first_token":
        rows, h = op.shapes["input"]
        e = K.nbytes(ctx.act)
        bwd.append(K.Kernel(f"{op.name}.backward", "memory_bound", 0, ctx.b * h * e, rows * h * e, ctx.act,
                            "backward", launches=2))
    casts: list[K.Kernel] = []
    shape = weight_matmul(op) if ctx.amp else None
    if shape is not None:
        n_in, n_out = shape
        for name, numel in (("weight", n_in * n_out), ("bias", n_out if op.attrs.get("bias") else 0)):
            if numel:
                casts.append(K.elementwise(f"{op.name}.{name}.cast", numel, ("float32",), (ctx.low,), ctx.low))
                casts.append(K._with(K.elementwise(f"{op.name}.{name}.grad_cast", numel, (ctx.low,), ("float32",),
                                                   "float32"), phase="backward"))
    again = [K._with(k, phase="recompute") for k in fwd] if op.attrs.get("recomputed") else []
    a = op.attrs
    if a.get("no_grad"):  # nothing before it needs a gradient (LoRA's blocks before the first adapter)
        return [k for k in casts if k.phase == "forward"] + fwd + again
    if a.get("frozen"):  # a frozen base Linear: no weight or bias gradient, nor its cast back to fp32
        bwd = [k for k in bwd if k.param_work not in ("weight_grad", "bias_grad")]
        casts = [k for k in casts if k.phase == "forward" and a.get("casts_weight", True)]
    elif not a.get("casts_weight", True):  # a trained 16-bit copy: autocast casts nothing
        casts = []
    return casts + fwd + bwd + again


def _saved(op: Op, ctx: Ctx) -> list[Saved]:
    """What the op keeps after the forward: nothing inside a checkpointed layer; its saved storages and, under
    autocast, its weight's cast (a Linear's matmul saves the cast weight for backward)."""
    if op.attrs.get("checkpointed"):
        return []
    return op_saved(op, ctx) + weight_cast(op, ctx)


def _transient_owner(ops: tuple[Op, ...], ctx: Ctx) -> int | None:
    """Index of the op a block's transients belong to: the first op saving the block's largest tensor
    (allocator-rounded). The memory model builds a block's forward peak from that tensor (its producer's
    output before the next op consumes it) and its backward peak from that tensor's gradient (a transformer
    layer's: the larger of the attention and MLP branches, each led by its largest saved tensor:
    activations.layer_backward_tensors). The inputs a checkpoint keeps set no peak. None: no op."""
    sizes = [max((alloc_bytes(t.nbytes, ctx.backend) for t in op_saved(op, ctx)), default=0)
             if op.kind != "checkpoint" else -1 for op in ops]
    return sizes.index(max(sizes)) if sizes else None


def program_report(model: ModelSpec, config: TrainConfig, share: Sharding, ctx: Ctx) -> dict[str, Any]:
    """The program of `model` under the resolved `config` and its context record `ctx`
    (planner.pipeline.resolve.context: the record the memory and speed interpreters read), as JSON."""
    from planner.pipeline.step import _activations

    load_rules()
    # the memory model's per-block transients (forward, backward) under the same record
    peaks = {a.block: max(a.forward_transient_bytes, a.backward_transient_bytes)
             for a in _activations(model, config, ctx)}
    program = model_program(model, ctx)
    param_bytes = None
    if config.lora:
        from planner.adapters.activations import adapters_of, lora_program
        from planner.adapters.lora import op_parameter_bytes, plan

        lora = plan(model, config)
        program = lora_program(model, config, lora, ctx)
        adapters = adapters_of(model, config, lora)

        def param_bytes(op: Op) -> int:
            return op_parameter_bytes(op, adapters, config)
    mode, modules = recompute_of(config)
    if mode == "full":
        specs = {b.name: b.layer for b in model_blocks(model) if isinstance(b.layer, TransformerSpec)}
        program = checkpoint_layers(program, specs)
    elif mode == "selective":
        program = recompute_selected(program, modules)
    p_bytes = parameter_dtype_bytes(config.precision)

    def resident(op: Op) -> int:
        full = param_bytes(op) if param_bytes else sum(p.numel for p in op.params) * p_bytes
        return share.block_bytes(full, 0)[0]

    blocks = blocks_json(program, ctx, resident, peaks, lambda op: apply("flops", op, ctx) * (1 + BACKWARD_TO_FORWARD))
    return {"front_end": "analytic", "blocks": blocks}


def blocks_json(program: Program, ctx: Ctx, param_bytes: Callable[[Op], int], peaks: dict[str, int],
                flops: Callable[[Op], int]) -> list[dict[str, Any]]:
    """`program.blocks[]` of a program, whichever front end made it: per op its parameters, what the memory
    interpreter says it saves (planner.memory.op_saved), the block's transient peak `peaks` on the op saving
    its largest storage, its FLOPs, and its kernels' bytes and launches (planner.perf.op_rules)."""
    blocks = []
    for block in program.blocks:
        ops = []
        owner = _transient_owner(block.ops, ctx)
        for i, op in enumerate(block.ops):
            kernels = op_kernels(op, ctx)
            ops.append({
                "kind": op.kind, "name": op.name,
                "shapes": {k: list(v) for k, v in op.shapes.items()},
                "params": [p.name for p in op.params],
                "param_bytes": param_bytes(op),
                "saved_bytes": sum(alloc_bytes(t.nbytes, ctx.backend) for t in _saved(op, ctx)),
                "transient_bytes": peaks.get(block.name, 0) if i == owner else 0,
                "flops": flops(op),
                "bytes_moved": sum(k.bytes * k.count for k in kernels),
                "launches": sum(k.launches * k.count for k in kernels),
            })
        blocks.append({"name": block.name, "ops": ops})
    return blocks


def traced_report(trace: Any, step_blocks: tuple, backend: str) -> dict[str, Any]:
    """The traced front end's `program.blocks[]`: the trace lowered to a program (planner.program.lower) and
    reported by the same `blocks_json` as a hand-modelled model's. `step_blocks`: the step memory's blocks
    (planner.memory.timeline.BlockMemory, the traced `_prepare`'s), whose resident parameter bytes go on each
    block's first op (the tracer counts a block's parameters, not their tensors) and whose transient peaks
    go where `blocks_json` puts them; `trace`: the step that was run (the checkpointed one under
    checkpointing), whose saved storages are the activations."""
    from planner.program.lower import traced_program

    load_rules()
    program = traced_program(trace, tuple(b.name for b in step_blocks),
                             {b.name: b.retained_bytes for b in step_blocks})
    ctx = Ctx(1, 1, "fp32", "sdpa", backend, False)  # a traced op's rules read only the backend (rounding)
    resident = {b.name: b.param_bytes for b in step_blocks}
    first = {id(b.ops[0]): resident.get(b.name, 0) for b in program.blocks if b.ops}
    peaks = {b.name: max(b.forward_transient_bytes, b.backward_transient_bytes) for b in step_blocks}
    return {"front_end": "traced",
            "blocks": blocks_json(program, ctx, lambda op: first.get(id(op), 0), peaks, lambda op: op.attrs["flops"])}

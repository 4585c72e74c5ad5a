"""Memory of one GPU through one training step, block by block, the way PyTorch allocates it.

The step is the steady state (optimizer states already exist) of the LAST micro-step of an accumulation
cycle, because that is the worst one: with `grad_accum > 1` the gradients of earlier micro-steps stay
allocated through its forward and backward. With `grad_accum == 1` `optimizer.zero_grad()` (set_to_none=True,
PyTorch >= 2.0 default) frees them before the forward, and backward allocates them block by block.

Phases:
- load: parameters, module buffers, DDP's gradient buckets (allocated when the model is wrapped).
- forward: + batch + optimizer states, and each block's saved activations accumulate; a block's transient
  temporaries sit on top while it runs. Under AMP the autocast cast cache (16-bit weight copies) lives until the
  forward ends, also for checkpointed blocks that do not save their casts.
- backward: blocks in reverse; a block's activations are freed after its backward, its gradients appear; a
  checkpointed block first recomputes its forward (its full saved set comes back for a moment).
- optimizer: parameters + gradients + states (allocated at the first step) + the step's temporaries.
The outputs a training loop keeps (`outputs = model(**batch)`: the logits) stay alive through backward and
the optimizer step, until the variable is rebound.

Everything is a pure function of `StepMemory`: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "batch", "buffers")


class BlockMemory(NamedTuple):
    """One block as resident on this GPU. A named tuple, not a frozen dataclass: a search makes one per block
    per new shape and parallelism, and hashes them in every step's cache key (made and hashed in C, ~5x
    cheaper)."""

    name: str
    param_bytes: int  # resident (sharded under ZeRO-3)
    grad_bytes: int  # resident after its backward (sharded under ZeRO-2/3)
    gathered_param_bytes: int  # extra while it runs under ZeRO-3 (all-gathered full parameters)
    transient_grad_bytes: int  # extra while its backward runs (unsharded gradients before reduce-scatter)
    kept_bytes: int  # activations that stay after its forward (incl. AMP weight casts)
    saved_bytes: int  # activations its forward saves when not checkpointed (incl. AMP weight casts)
    forward_transient_bytes: int
    backward_transient_bytes: int
    checkpointed: bool
    forward_cache_bytes: int = 0  # AMP cast cache not saved for backward: alive until autocast exits
    retained_bytes: int = 0  # outputs the training loop holds (logits): alive through backward and the step
    # part of FSDP1's root unit (the modules outside the wrapped layers): unsharded from the start of the forward
    # to the end of the backward, each block's part of its unsharded gradient from that block's backward on
    root_unit: bool = False
    # FSDP2 `reshard_after_forward=False` (frameworks.Framework.reshard_after_forward, NeMo AutoModel): the block's
    # unit stays gathered from its forward to the end of its backward; `gathered_param_bytes` is then that one
    # unit (the next unit's prefetch in forward is not counted: it is held from its own forward on anyway)
    gathered_until_backward: bool = False
    # FSDP1's no_sync() accumulation (framework_layout.StateLayout.synced_grad_bytes): the gradient the block
    # holds at the optimizer step, its fp32 shard after the last micro-step's reduce-scatter, where `grad_bytes`
    # is the whole 16-bit gradient kept through the micro-steps' backward (-1: `grad_bytes` at the step too)
    synced_grad_bytes: int = -1


@dataclass(frozen=True)
class StepMemory:
    blocks: tuple[BlockMemory, ...]
    module_buffer_bytes: int  # BatchNorm running stats, position-id buffers
    ddp_bucket_bytes: int  # DDP gradient buckets (0 with gradient_as_bucket_view or without DDP)
    workspace_bytes: int  # cuBLAS workspace, allocated through the caching allocator at the first matmul
    batch_bytes: int
    optimizer_state_bytes: int
    optimizer_temporary_bytes: int
    grads_resident: bool  # gradients from earlier micro-steps stay allocated (grad_accum > 1)
    extra_forward_bytes: int = 0  # DataParallel on GPU 0: the whole batch before scatter + gathered outputs
    # The training loop's lifetimes (planner.memory.loops): when the outputs the loop holds (`retained_bytes`)
    # and the gradients die; the defaults are the plain loop's.
    outputs_die: str = "step-end"
    grads_die: str = "step-end"
    # --load cast: the fp32 build behind each parameter byte (loops.build_ratio; 0: built in its dtype).
    build_ratio: int = 0
    # Accelerate's mixed precision returns the model's 16-bit outputs converted to fp32 (loops.LoopRule): a copy
    # alive at the end of the forward only.
    outputs_fp32_bytes: int = 0
    # The optimizer's state and step-temporary tensors, bytes each, where the step's builder knows the rank's
    # own (planner.pipeline.step: a Megatron pipeline rank's per-parameter shards); None: the allocator trace
    # splits the totals by its own rule (planner.memory.events.optimizer_tensor_sizes). Read by the trace only.
    optimizer_tensors: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class Point:
    """Allocated bytes by category at one moment of the step."""

    phase: str
    label: str
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


Row = tuple[str, str, int, int, int, int, int, int]  # phase, label, then the bytes of each of CATEGORIES


def _rows(step: StepMemory) -> list[Row]:
    """The step's points as plain rows: after load, during/after each block forward and backward, optimizer."""
    blocks = step.blocks
    params = sum(b.param_bytes for b in blocks)
    grads_total = sum(b.grad_bytes for b in blocks)
    static_buffers = step.module_buffer_bytes + step.ddp_bucket_bytes
    rows: list[Row] = []
    if step.build_ratio:  # --load cast: every parameter built in fp32 before the cast
        rows.append(("load", "fp32 build", params * step.build_ratio, 0, 0, 0, 0, 0))  # (buffers come after)
    rows.append(("load", "after load", params, 0, 0, 0, 0, static_buffers))

    base_buffers = static_buffers + step.workspace_bytes + step.extra_forward_bytes
    grads = grads_total if step.grads_resident else 0
    states, batch = step.optimizer_state_bytes, step.batch_bytes
    # what the previous step leaves alive through this forward (planner.memory.loops)
    carried_grads = grads_total if step.grads_die == "next-backward" and not step.grads_resident else 0
    outputs_total = sum(b.retained_bytes for b in blocks)
    carried = outputs_total if step.outputs_die == "next-forward" else 0

    # FSDP1's root unit (BlockMemory.root_unit): gathered for the whole step
    root_p = sum(b.gathered_param_bytes for b in blocks if b.root_unit)
    kept = cache = held = 0  # held: units gathered until their backward (BlockMemory.gathered_until_backward)
    for b in blocks:
        running = (b.kept_bytes if b.checkpointed else b.saved_bytes) + b.forward_cache_bytes + b.retained_bytes
        gathered = root_p if b.root_unit else root_p + held + b.gathered_param_bytes
        rows.append(("forward", b.name, params + gathered, grads + carried_grads, states,
                     kept + cache + running + carried, batch, base_buffers + b.forward_transient_bytes))
        kept += b.kept_bytes + b.retained_bytes
        cache += b.forward_cache_bytes
        if b.gathered_until_backward:
            held += b.gathered_param_bytes
    rows.append(("forward", "end of forward", params + root_p + held, grads + carried_grads, states,
                 kept + cache + carried, batch, base_buffers + step.outputs_fp32_bytes))
    if step.outputs_die == "forward-end":  # the loop returned only the loss: the outputs die before backward
        kept -= outputs_total

    # the root's unsharded gradient, piece by piece: each root block's part from its own backward to the end.
    # FSDP1's parameters are views of the flat parameter (torch.split + view, _flat_param.py
    # FlatParamHandle._get_unflat_views), so the head's gradient waits in autograd's buffer for the split's
    # backward until the embeddings' gradient arrives; during the layers' backward only the head's (and the
    # final norm's) part exists (tests/test_frameworks.py measures it on CPU).
    root_grads = 0
    for b in reversed(blocks):
        recompute = b.saved_bytes - b.kept_bytes if b.checkpointed else 0
        new_grads = 0 if step.grads_resident else b.grad_bytes
        if b.root_unit:
            root_grads += b.transient_grad_bytes
        own = 0 if b.gathered_until_backward else b.gathered_param_bytes  # a held unit is counted in `held`
        gathered = root_p if b.root_unit else root_p + held + own
        transient = 0 if b.root_unit else b.transient_grad_bytes
        rows.append(("backward", b.name, params + gathered,
                     grads + new_grads + transient + root_grads, states, kept + recompute, batch,
                     base_buffers + b.backward_transient_bytes))
        kept -= b.kept_bytes
        grads += new_grads
        if b.gathered_until_backward:
            held -= b.gathered_param_bytes
    step_grads = sum(b.grad_bytes if b.synced_grad_bytes < 0 else b.synced_grad_bytes for b in blocks)
    rows.append(("optimizer", "optimizer step", params, step_grads, states, kept, batch,
                 static_buffers + step.workspace_bytes + step.optimizer_temporary_bytes))
    return rows


def _to_point(row: Row) -> Point:
    return Point(row[0], row[1], {c: int(n) for c, n in zip(CATEGORIES, row[2:], strict=True)})


def simulate(step: StepMemory) -> list[Point]:
    """The step as a sequence of points: after load, during/after each block forward and backward, optimizer."""
    return [_to_point(r) for r in _rows(step)]


def peaks(step: StepMemory) -> tuple[dict[str, Point], Point]:
    """`(phase_peaks(simulate(step)), peak(simulate(step)))`, making Points of the peaks only: a search asks
    this of every new step, and only the peaks are kept."""
    best: dict[str, tuple[int, Row]] = {}
    top: tuple[int, Row] | None = None
    for r in _rows(step):
        total = r[2] + r[3] + r[4] + r[5] + r[6] + r[7]
        held = best.get(r[0])
        if held is None or total > held[0]:
            best[r[0]] = (total, r)
        if top is None or total > top[0]:
            top = (total, r)
    assert top is not None  # a step has at least its load and optimizer points
    return {phase: _to_point(r) for phase, (_, r) in best.items()}, _to_point(top[1])


def phase_peaks(points: list[Point]) -> dict[str, Point]:
    """The highest point of each phase, in phase order."""
    peaks: dict[str, Point] = {}
    for p in points:
        if p.phase not in peaks or p.total > peaks[p.phase].total:
            peaks[p.phase] = p
    return peaks


def peak(points: list[Point]) -> Point:
    return max(points, key=lambda p: p.total)

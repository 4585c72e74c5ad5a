"""The traced step's own storage events replayed through the caching-allocator model (`memory.allocator`).

Why: for a traced model the allocation trace is measured, op by op, so the reserved peak need not assume a
flat fragmentation. The trace is one *first* step, and the replay runs it twice, as a training run does:
  1. permanent storages: parameters, buffers, DDP's gradient buckets (`events.buckets`, same rule as the
     analytic replay), the cuBLAS workspace;
  2. the first step in traced order, the optimizer states allocated where the trace made them (inside the
     first `optimizer.step()`, after backward freed the activations, so they land in the activations' cached
     segments: the main reason reserved exceeds allocated in steady training, as `events.step_events` says);
  3. the steady step: the same events again, without the states, which now exist.
What the training loop holds between steps follows `--loop` (`planner.memory.loops`): the model outputs it
keeps (the logits, `StepTrace.retained_storages`) and the gradients die when the loop lets them; everything
else the step made (the loss, the batch, the optimizer's scalars) dies when the step ends.

The steady step alone, with the states allocated before it (what this module replayed before), misses what
the first step leaves in the cache: on the shared H200 reading of BERT-base (fp32, 8 × 128, its catalog config traced) it
reserved 8.6 % under the GPU; the two steps, 0.7 % under (docs/allocator.md).
Storages the device does not hold (host RNG state, 0 bytes) are skipped: the allocator reads 0 as a free.
"""

from __future__ import annotations

from dataclasses import replace

from planner.memory import allocator, events
from planner.memory.loops import DEFAULT_LOOP, rule
from planner.program.records import StepTrace
from planner.spec import AllocatorReplay

PERMANENT = ("parameter", "buffer")
STATE = "optimizer_state"


def _forward_end(trace: StepTrace) -> int:
    """Index of the first op after the forward (the loss's backward), len(ops) if none."""
    return next((o.index for o in trace.ops if o.phase != "forward"), len(trace.ops))


def _parts(trace: StepTrace, bucket_sizes: tuple[int, ...], workspace_bytes: int
           ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int, int, str]],
                      dict[int, str]]:
    """Permanent allocations, the buckets and workspace, the step's events (op, sid, nbytes or 0, category),
    a name per id."""
    names: dict[int, str] = {}
    perm: list[tuple[int, int]] = []
    step: list[tuple[int, int, int, str]] = []
    skipped: set[int] = set()
    freed = {e.storage for e in trace.events if e.action == "free"}
    n_ops = len(trace.ops)
    for e in trace.events:
        if (e.action == "alloc" and e.storage not in freed and e.category == "temporary" and 0 <= e.op < n_ops
                and trace.ops[e.op].phase == "optimizer"):
            e = replace(e, category=STATE)  # the optimizer's own scalars (AdamW's state["step"]): kept as states
        if e.action == "alloc" and e.nbytes <= 0:
            skipped.add(e.storage)
            continue
        if e.storage in skipped:
            continue
        if e.action == "alloc":
            names[e.storage] = e.category
        if e.action == "alloc" and e.category in PERMANENT:
            perm.append((e.storage, e.nbytes))
        else:
            step.append((e.op, e.storage, e.nbytes if e.action == "alloc" else 0, names.get(e.storage, e.category)))
    next_id = max(names, default=0) + 1
    extra = []
    for size in (*bucket_sizes, workspace_bytes):
        if size > 0:
            names[next_id] = "ddp_bucket" if len(extra) < len(bucket_sizes) else "cublas_workspace"
            extra.append((next_id, size))
            next_id += 1
    return perm, extra, step, names


def run_events(trace: StepTrace, *, bucket_sizes: tuple[int, ...] = (), workspace_bytes: int = 0,
               loop: str = DEFAULT_LOOP) -> tuple[tuple[tuple[int, int], ...], dict[int, str]]:
    """(tensor_id, nbytes) events of load, the first step and the steady step (module doc), a name per id.

    The steady step's storages get ids of their own (its storage id + `offset`). Where the loop frees what
    it holds (`loops.LoopRule`): outputs at "forward-end" (before the loss's backward), "step-end" or
    "next-forward" (when the next step's forward ends); gradients at "step-end" or "next-backward" (the next
    step's forward end, before its backward)."""
    perm, extra, step, names = _parts(trace, bucket_sizes, workspace_bytes)
    lr = rule(loop)
    retained = {sid for _, sid in trace.retained_storages}
    # where the forward ends in the step's event list: the first event of an op after the forward
    end = _forward_end(trace)
    cut = next((i for i, e in enumerate(step) if e[0] >= end), len(step))
    offset = max(names, default=0) + 1
    for sid, cat in list(names.items()):
        if sid < offset and cat not in (*PERMANENT, "ddp_bucket", "cublas_workspace"):
            names[sid + offset] = cat

    def one(k: int, carried_grads: list[int], carried_outputs: list[int]) -> tuple[list[tuple[int, int]],
                                                                                   list[int], list[int]]:
        shift = k * offset
        out: list[tuple[int, int]] = []
        live: dict[int, str] = {}
        for i, (_, sid, n, cat) in enumerate(step):
            if i == cut:  # the forward ended: the previous step's carried tensors, and outputs dying now
                out += [(t, 0) for t in (*carried_outputs, *carried_grads)]
                if lr.outputs_die == "forward-end":
                    dying = [s for s in live if s in retained]
                    out += [(s + shift, 0) for s in dying]
                    for s in dying:
                        del live[s]
            if cat == STATE and k > 0:
                continue  # the states exist from the first step on
            out.append((sid + shift, n))
            if n:
                live[sid] = cat
            else:
                live.pop(sid, None)
        if cut >= len(step):
            out += [(t, 0) for t in (*carried_outputs, *carried_grads)]
        grads = [s + shift for s, c in live.items() if c == "gradient"]
        outputs = [s + shift for s in live if s in retained]
        rest = [s + shift for s, c in live.items() if c != STATE and c != "gradient" and s not in retained]
        carry_grads, carry_outputs = lr.grads_die == "next-backward", lr.outputs_die == "next-forward"
        out += [(t, 0) for t in (*rest, *([] if carry_outputs else outputs), *([] if carry_grads else grads))]
        return out, grads if carry_grads else [], outputs if carry_outputs else []

    first, grads, outputs = one(0, [], [])
    steady, _, _ = one(1, grads, outputs)
    return tuple(perm + extra + first + steady), names


def replay_trace(trace: StepTrace, *, ddp_bucket_bytes: int = 0, bucket_cap_bytes: int = 25 * events.MiB,
                 workspace_bytes: int = 0, capacity_bytes: int | None = None,
                 expandable_segments: bool = False, loop: str = DEFAULT_LOOP) -> AllocatorReplay:
    """The allocator's peaks over the first and the steady step (the OOM retry when `capacity_bytes` is
    exceeded)."""
    buckets = events.buckets(ddp_bucket_bytes, bucket_cap_bytes) if ddp_bucket_bytes else ()
    evs, names = run_events(trace, bucket_sizes=buckets, workspace_bytes=workspace_bytes, loop=loop)
    r = allocator.replay(evs, expandable_segments=expandable_segments)
    if capacity_bytes is not None and r.peak_reserved > capacity_bytes:
        r = allocator.replay(evs, capacity_bytes=capacity_bytes, expandable_segments=expandable_segments)
    return AllocatorReplay(peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved, segments=r.segments,
                           peak_allocation=names.get(r.peak_tensor, "") if r.peak_tensor >= 0 else "",
                           peak_allocation_bytes=r.peak_event_bytes, peak_segment_bytes=r.peak_segment_bytes,
                           oom_retry=r.oom_retry, oom_after_retry=r.oom, expandable_segments=expandable_segments,
                           events=len(evs))

"""Trace five layers of a stack of identical layers and write out the rest: the same trace, a fraction of the cost.

Why: a transformer repeats one layer (T5-base: 2 × 11 of its 24, Qwen2-0.5B: 24 of 24), and tracing runs every
op of every layer through FakeTensorMode in Python (≈ 3 s CPU for T5-base at 16 × 512, issue 38). Where the
layers are provably the same module, their ops, storages and saved tensors repeat from one layer to the next;
the tracer then runs the model with five layers of the run (the first three, A B C, and the last two, D E),
and this module writes the removed layers' part of the trace (between C and D) as copies of C's, which is
what the whole model's trace holds.

Proven, not assumed:
- before the trace (`find_runs`): the layers of a run are consecutive numbered children of one ModuleList or
  Sequential, each a block of its own (`trace.block_of`), of the same class with the same parameters (names,
  shapes, dtypes, requires_grad), buffers, hooks and attributes in every submodule (the same config object);
  an int attribute that holds each layer's own position in every layer of the list (`layer_idx`) is its
  index, not a difference. ASSUMPTION: the index is read for the KV cache, which a training step does not
  keep (`hf.hf_config_object` sets use_cache False), not to branch on in forward; a branch on it in the
  first three or last two layers shows in the check below. No parameter of a removed layer is shared;
- after (`expand`): layer B's part of the trace, shifted one layer on, is C's, op for op (name, shapes,
  dtypes, FLOPs, module, block), storage event for storage event (a storage a layer allocates stands at the
  same op, counted from the layer's first op, as the next layer's) and saved tensor for saved tensor; each
  layer's events touch only its own and its neighbours' storages; a storage of B freed outside the layers is
  freed there for C too; no output the loop keeps is B's or C's. An event belongs to the layer whose op
  caused it (a storage that died between two ops, a local released as a layer returned, to the op before),
  and the written-out events are put back in the order the tracer records them. Otherwise `expand` returns
  None and the tracer traces the whole model (`trace.trace_step`);
- not under checkpointing (a layer's recomputation runs before autograd names its block: the whole model is
  traced, as before).

The written-out trace is the whole model's, event for event: tests/test_trace_periodic.py compares every
field of both traces and the estimate JSON on T5, BART and Qwen2 configs at several shapes and precisions.
The optimizer step is not written out: it runs over every parameter of the whole model (the removed layers'
parameters with stand-in gradients that stand for the copies' gradient storages), so its multi-tensor ops
are the whole model's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

from planner.program.records import OpRecord, SavedRecord

KEPT_AHEAD = 3  # layers A, B, C traced at the start of a run (B checked against C, C copied); D, E = the last two
MIN_COPIES = 1  # a run is cut only when it saves tracing at least this many layers
TEMPLATE = 2  # C: the layer copied, between C and D

# the parts of a module's __dict__ compared by their own rule (parameters, buffers, children) or not at all
_OWN_RULE = frozenset({"_parameters", "_buffers", "_modules"})


# ------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    """Layers `first`..`last` of `parent` (a ModuleList or Sequential) are the same module; the tracer keeps
    A, B, C = first..first+2 and D, E = last-1, last, and the layers between C and D are written out as copies
    of C."""

    parent: Any  # the container, truncated while the trace runs
    names: list[str]  # qualified names of all its children, in order
    first: int
    last: int
    layers: list[Any] = field(default_factory=list)  # every child, in order (the removed ones too)

    @property
    def kept(self) -> tuple[str, ...]:
        """A, B, C, D and the last, E."""
        return (*self.names[self.first:self.first + KEPT_AHEAD], self.names[self.last - 1], self.names[self.last])

    @property
    def copies(self) -> list[str]:
        """The removed layers' names, in forward order: the copies of C."""
        return self.names[self.first + KEPT_AHEAD:self.last - 1]

    def removed_layers(self) -> list[Any]:
        return self.layers[self.first + KEPT_AHEAD:self.last - 1]


def _value(v: Any) -> Any:
    """What an attribute contributes to a layer's identity (tensors by shape and dtype; a partial by what it
    calls)."""
    import torch

    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.requires_grad)
    if isinstance(v, functools.partial):
        return ("partial", v.func, v.args, tuple(sorted(v.keywords.items())))
    if isinstance(v, dict) and v and all(isinstance(k, int) for k in v):  # hook dicts: keyed by handle ids
        return ("hooks", tuple(v.values()))
    return v


def _signature(layer: Any, positions: set[tuple[str, str]]) -> list[tuple]:
    """A layer's modules, attributes, parameters and buffers; `positions`: the (module, attribute) pairs that
    hold each layer's own position in the list (`layer_idx`), left out."""
    out = []
    for name, m in layer.named_modules(remove_duplicate=False):
        attrs = tuple((k, _value(v)) for k, v in sorted(vars(m).items())
                      if k not in _OWN_RULE and (name, k) not in positions)
        params = tuple((n, _value(p)) for n, p in m._parameters.items())
        buffers = tuple((n, _value(b)) for n, b in m._buffers.items())
        out.append((name, type(m), attrs, params, buffers))
    return out


def _positions(layers: list[Any]) -> set[tuple[str, str]]:
    """(module, attribute) pairs whose value is, in every layer of the list, that layer's position (an int):
    the layer's index, which the KV cache reads (module docstring), not a difference between layers."""
    found: set[tuple[str, str]] | None = None
    for i, layer in enumerate(layers):
        here = {(name, k) for name, m in layer.named_modules(remove_duplicate=False) for k, v in vars(m).items()
                if isinstance(v, int) and not isinstance(v, bool) and v == i}
        found = here if found is None else found & here
    return found or set()


def _same(a: list[tuple], b: list[tuple]) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an attribute whose == is not a truth value (an array): not provably the same
        return False


def find_runs(module: Any, block_of: Callable[[str], str]) -> list[Run]:
    """Runs of at least KEPT_AHEAD + 2 + MIN_COPIES identical layers (module docstring), outermost first."""
    runs: list[Run] = []
    for parent_name, parent in module.named_modules():
        children = list(parent._modules.items())
        if len(children) < KEPT_AHEAD + 2 + MIN_COPIES or [k for k, _ in children] != [str(i) for i in
                                                                                      range(len(children))]:
            continue
        if any(parent_name.startswith(r.names[0].rsplit(".", 1)[0] + ".") for r in runs):
            continue  # inside a run's layer: not a block
        names = [f"{parent_name}.{k}" if parent_name else k for k, _ in children]
        if any(block_of(n) != n for n in names):
            continue
        layers = [m for _, m in children]
        if any(m is None for m in layers):
            continue
        positions = _positions(layers)
        sigs = [_signature(m, positions) for m in layers]
        start = 0
        while start < len(layers):
            end = start
            while end + 1 < len(layers) and _same(sigs[start], sigs[end + 1]):
                end += 1
            if end - start + 1 >= KEPT_AHEAD + 2 + MIN_COPIES:
                run = Run(parent, names, start, end, layers)
                if not _shares_parameters(module, run):
                    runs.append(run)
            start = end + 1
    return runs


def _shares_parameters(module: Any, run: Run) -> bool:
    """Whether a removed layer holds a parameter or buffer that anything else holds too."""
    removed = {id(t) for m in run.removed_layers() for t in [*m.parameters(), *m.buffers()]}
    inside = {id(m) for layer in run.removed_layers() for m in layer.modules()}
    for m in module.modules():
        if id(m) in inside:
            continue
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and id(t) in removed:
                return True
    return False


def truncate(run: Run) -> None:
    """Keep A, B, C, D, E and every layer outside the run (numbered again from 0, as a shorter list would be)."""
    keep = [*run.layers[:run.first + KEPT_AHEAD], *run.layers[run.last - 1:]]
    run.parent._modules.clear()
    for i, m in enumerate(keep):
        run.parent._modules[str(i)] = m


def restore(run: Run) -> None:
    run.parent._modules.clear()
    for i, m in enumerate(run.layers):
        run.parent._modules[str(i)] = m


# ------------------------------------------------------------------------------------------- the raw trace


@dataclass
class Raw:
    """The tracer's records before they become a StepTrace; storage ids are ints, or tuples for written-out
    copies until `renumber`."""

    ops: list[OpRecord]
    op_block: list[str]
    # (op, action, storage id, stage, late), in order: stage 0 an op's result, 1 a free, 2 another allocation;
    # late: a free whose storage died before its op began (trace._Recorder.event_stage, event_late)
    events: list[tuple[int, str, Hashable, int, bool]]
    meta: dict[Hashable, tuple[int, str, str]]  # storage id -> (device bytes, device dtype, category)
    saved: list[SavedRecord]
    saved_op: list[int]  # the op each saved record was packed after
    retained: list[tuple[str, Hashable]]  # (block, storage id) of the outputs the loop keeps
    standins: dict[Hashable, tuple[str, Hashable]] = field(default_factory=dict)  # stand-in grad -> (copy, C's)

    @property
    def forward_end(self) -> int:
        return sum(op.phase == "forward" for op in self.ops)

    @property
    def backward_end(self) -> int:
        return self.forward_end + sum(op.phase == "backward" for op in self.ops)


class _NotPeriodic(Exception):
    """The trace does not repeat as the run's modules do: trace the whole model."""


def _rename(name: str, src: str, dst: str) -> str:
    if name == src:
        return dst
    if name.startswith(src + "."):
        return dst + name[len(src):]
    return name


def _window(blocks: list[str], lo: int, hi: int, name: str) -> tuple[int, int]:
    """The first and last of the ops in [lo, hi) that ran for `name` (ops of blocks outside the run may run
    between them: T5's backward of the attention bias, which autograd attributes to layer 0, in every
    layer's backward; they are part of the layer's window, checked and copied with it)."""
    first = next((i for i in range(lo, hi) if blocks[i] == name), None)
    if first is None:
        raise _NotPeriodic
    last = next(i for i in range(hi - 1, lo - 1, -1) if blocks[i] == name)
    return first, last


def expand(raw: Raw, run: Run) -> Raw | None:
    """The whole model's records from the truncated model's (module docstring); None where they do not repeat."""
    try:
        return _expand(raw, run)
    except _NotPeriodic:
        return None


def _expand(raw: Raw, run: Run) -> Raw:  # noqa: C901 - one pass per record kind, kept together
    names = run.kept
    _, B, C, _, _ = names
    copies = run.copies
    k = len(copies)
    fe, be = raw.forward_end, raw.backward_end
    blocks = raw.op_block
    f = [_window(blocks, 0, fe, n) for n in names]
    b = [_window(blocks, fe, be, n) for n in names]
    # in order, forward and backward; in backward the first layer's block may also name ops of the others: a
    # tensor every layer saves (a mask, rotary cos/sin) is recorded once, by the first layer to save it, and
    # autograd's unpacking of it in each later layer's backward names that layer's ops after it
    if any(f[n][1] >= f[n + 1][0] or b[n + 1][1] >= b[n][1] for n in range(4)) or any(
            b[n + 1][1] >= b[n][0] for n in range(1, 4)):
        raise _NotPeriodic
    # windows (first op, last op): a layer's forward takes the ops since the previous layer's (the stack's own
    # ops between layers), its backward those since the next layer's backward (ops before a layer first
    # unpacks a saved tensor are attributed to the block before); the first layer's forward and the last
    # layer's backward, which have no such neighbour in the run, take as many ops before their own first
    lead_f, lead_b = f[2][0] - f[1][1] - 1, b[2][0] - b[3][1] - 1
    win = {(0, "f"): (f[0][0] - lead_f, f[0][1]), (4, "b"): (b[4][0] - lead_b, b[4][1])}
    for n in range(1, 5):
        win[(n, "f")] = (f[n - 1][1] + 1, f[n][1])
        win[(n - 1, "b")] = (b[n][1] + 1, b[n - 1][1])
    if win[(0, "f")][0] < 0 or win[(4, "b")][0] < fe:
        raise _NotPeriodic
    anchor = {(n, part): lo + (lead_f if part == "f" else lead_b) for (n, part), (lo, _) in win.items()}

    def where(op: int) -> tuple[int, str] | None:
        for key, (lo, hi) in win.items():
            if lo <= op <= hi:
                return key
        return None

    # each storage's home: the layer and phase that allocated it, the op that did (counted from the layer's
    # own first op in that phase) and its place among that op's allocations; the same storage of another
    # layer has the same key
    by_key: dict[tuple[int, str, int, int], Hashable] = {}
    home: dict[Hashable, tuple[int, str, int, int]] = {}
    # an event belongs to the layer whose op caused it: a storage that died between two ops (a layer's
    # local released when it returned) to the op before
    ev_at: dict[tuple[int, str], list[tuple[int, str, Hashable, int, bool]]] = {key: [] for key in win}
    outside_frees: list[tuple[int, str, Hashable, int, bool]] = []
    made_at: dict[int, int] = {}
    for e in raw.events:
        op, action, sid, _, late = e
        key = where(op - late)
        if action == "alloc" and key is not None:
            nth = made_at[op] = made_at.get(op, -1) + 1
            home[sid] = (*key, op - anchor[key], nth)
            by_key[home[sid]] = sid
        if key is not None:
            ev_at[key].append(e)
        elif action == "free":
            outside_frees.append(e)

    def at(n: int, part: str, d: int, nth: int) -> Hashable:
        sid = by_key.get((n, part, d, nth))
        if sid is None:
            raise _NotPeriodic
        return sid

    # neighbours only: each layer's events touch its own storages and its neighbours'
    for (n, _), evs in ev_at.items():
        for _, _, sid, _, _ in evs:
            h = home.get(sid)
            if h is not None and abs(h[0] - n) > 1:
                raise _NotPeriodic

    def shift(sid: Hashable) -> Hashable:
        h = home.get(sid)
        return sid if h is None else at(h[0] + 1, *h[1:])

    # B, shifted one layer on, is C
    for part in ("f", "b"):
        (lb, hb), (lc, hc) = win[(1, part)], win[(2, part)]
        if hb - lb != hc - lc:
            raise _NotPeriodic
        for i in range(hb - lb + 1):
            x, y = raw.ops[lb + i], raw.ops[lc + i]
            if (x.name, x.phase, x.inputs, x.outputs, x.flops, x.kernel) != (
                    y.name, y.phase, y.inputs, y.outputs, y.flops, y.kernel) \
                    or _rename(x.module, B, C) != y.module or _rename(blocks[lb + i], B, C) != blocks[lc + i]:
                raise _NotPeriodic
        eb, ec = ev_at[(1, part)], ev_at[(2, part)]
        if len(eb) != len(ec):
            raise _NotPeriodic
        for (ob, ab, sb, gb, late_b), (oc, ac, sc, gc, late_c) in zip(eb, ec, strict=True):
            if (ob - lb, ab, gb, late_b) != (oc - lc, ac, gc, late_c) or shift(sb) != sc:
                raise _NotPeriodic
    freed_b = {(op, late, shift(sid)) for op, _, sid, _, late in outside_frees if home.get(sid, (-1,))[0] == 1}
    freed_c = {(op, late, sid) for op, _, sid, _, late in outside_frees if home.get(sid, (-1,))[0] == 2}
    if freed_b != freed_c:
        raise _NotPeriodic
    # saved tensors by their block (autograd saves an op's inputs before the op runs, so a layer's first saved
    # tensor is packed after the previous layer's last op); none of another block inside the run's windows
    saved_in: dict[int, list[int]] = {n: [] for n in range(5)}
    for i, rec in enumerate(raw.saved):
        if rec.block in names:
            saved_in[names.index(rec.block)].append(i)
        elif any(lo <= raw.saved_op[i] < hi for lo, hi in win.values()):
            raise _NotPeriodic
    sb_, sc_ = saved_in[1], saved_in[2]
    if len(sb_) != len(sc_):
        raise _NotPeriodic
    for i, j in zip(sb_, sc_, strict=True):
        x, y = raw.saved[i], raw.saved[j]
        if (replace(x, storage=shift(x.storage), block=_rename(x.block, B, C), module=_rename(x.module, B, C))
                != replace(y, storage=y.storage)) or raw.saved_op[i] - win[(1, "f")][0] != raw.saved_op[j] - \
                win[(2, "f")][0]:
            raise _NotPeriodic
    if any(home.get(sid, (-1,))[0] in (1, 2) for _, sid in raw.retained):  # an output of the last layer is fine
        raise _NotPeriodic

    # storage ids in the whole trace: C = copy 0, copies 1..k, D = copy k + 1, B = -1, A = -2
    def copy_of(sid: Hashable, j: int) -> Hashable:
        """Storage `sid`, as referenced from C's window, referenced from copy j's (j = 0: C itself)."""
        h = home.get(sid)
        if h is None:
            return sid
        t = j + h[0] - 2
        if t <= 0:
            return at(2 + t, *h[1:])
        if t <= k:
            return ("copy", run.names[run.first], t, *h[1:])
        if t == k + 1:
            return at(3, *h[1:])
        raise _NotPeriodic

    def across(sid: Hashable, n: int) -> Hashable:
        """An original window's (layer n) reference, with the copies between C and D."""
        h = home.get(sid)
        if h is None:
            return sid
        if n == 3 and h[0] == 2:
            return copy_of(sid, k)
        if n == 2 and h[0] == 3:
            return ("copy", run.names[run.first], 1, *h[1:])
        return sid

    (lf, hf_), (lb_, hb__) = win[(2, "f")], win[(2, "b")]
    nf, nb = hf_ - lf + 1, hb__ - lb_ + 1
    cut_f, cut_b = f[2][1], b[3][1]  # copies' forwards go after C's, their backwards after D's

    def new_op(i: int) -> int:
        if i <= cut_f:
            return i
        if i <= cut_b:
            return i + k * nf
        return i + k * (nf + nb)

    ops: list[OpRecord] = []
    op_block: list[str] = []

    def put(rec: OpRecord, block: str) -> None:
        # positional: `dataclasses.replace` per op was a tenth of writing the layers out
        ops.append(rec if rec.index == len(ops) else OpRecord(len(ops), rec.name, rec.phase, rec.module, rec.inputs,
                                                              rec.outputs, rec.flops, rec.kernel))
        op_block.append(block)

    for i, rec in enumerate(raw.ops):
        put(rec, blocks[i])
        if i == cut_f or i == cut_b:
            part, lo, hi = ("f", lf, hf_) if i == cut_f else ("b", lb_, hb__)
            order = range(1, k + 1) if part == "f" else range(k, 0, -1)
            for j in order:
                for c in range(lo, hi + 1):
                    src = raw.ops[c]
                    put(OpRecord(src.index, src.name, src.phase, _rename(src.module, C, copies[j - 1]), src.inputs,
                                 src.outputs, src.flops, src.kernel),
                        _rename(blocks[c], C, copies[j - 1]))

    meta = dict(raw.meta)
    events: list[tuple[int, str, Hashable, int, bool]] = []

    def copy_events(part: str) -> None:
        lo = win[(2, part)][0]
        base = cut_f + 1 if part == "f" else cut_b + 1 + k * nf
        order = range(1, k + 1) if part == "f" else range(k, 0, -1)
        for pos, j in enumerate(order):
            for op, action, sid, stage, late in ev_at[(2, part)]:
                new = copy_of(sid, j)
                if action == "alloc":
                    meta[new] = raw.meta[sid]
                events.append((base + pos * (nf if part == "f" else nb) + op - lo, action, new, stage, late))

    done = {"f": False, "b": False}
    for op, action, sid, stage, late in raw.events:
        cause = op - late
        for part, cut in (("f", cut_f), ("b", cut_b)):
            if not done[part] and cause > cut:
                copy_events(part)
                done[part] = True
        key = where(cause)
        at_op = new_op(cause) + late
        events.append((at_op, action, across(sid, key[0]) if key is not None else sid, stage, late))
        if key is None and action == "free" and home.get(sid, (-1,))[0] == 2:  # the copies' too
            events.extend((at_op, "free", copy_of(sid, j), stage, late) for j in range(1, k + 1))
    for part in ("f", "b"):
        if not done[part]:
            copy_events(part)

    saved: list[SavedRecord] = []
    saved_op: list[int] = []
    last_c = max(saved_in[2], default=-1)
    for i, rec in enumerate(raw.saved):
        n = names.index(rec.block) if rec.block in names else None
        if n is None and home.get(rec.storage, (-1,))[0] in (1, 2):
            raise _NotPeriodic  # saved outside the layers: which copy's would it be?
        saved.append(replace(rec, storage=across(rec.storage, n)) if n is not None else rec)
        saved_op.append(new_op(raw.saved_op[i]))
        if i == last_c:
            for j in range(1, k + 1):
                for c in saved_in[2]:
                    src = raw.saved[c]
                    saved.append(replace(src, storage=copy_of(src.storage, j),
                                         block=_rename(src.block, C, copies[j - 1]),
                                         module=_rename(src.module, C, copies[j - 1])))
                    saved_op.append(cut_f + 1 + (j - 1) * nf + raw.saved_op[c] - lf)

    # a stand-in gradient has no event: it stands for the copy's storage where C's gradient is C's own (else for
    # nothing; the copies' gradient events are C's, checked above)
    standins = {}
    for sid, (layer, grad) in raw.standins.items():
        h = home.get(grad)
        standins[sid] = (layer, copy_of(grad, copies.index(layer) + 1) if layer in copies and h is not None
                         and h[0] == 2 else grad)
    return Raw(ops, op_block, _in_order(events), meta, saved, saved_op, list(raw.retained), standins)


def _in_order(events: list[tuple[int, str, Hashable, int, bool]]) -> list[tuple[int, str, Hashable, int, bool]]:
    """The order the tracer records events in: by op; at one op its results' allocations, then its frees in
    allocation order (`trace._Recorder._poll` sorts them by storage id, which is allocation order), then
    autograd's allocations; otherwise as written."""
    seq = sorted(range(len(events)), key=lambda i: (events[i][0], events[i][3], i))
    rank = {}
    for i in seq:
        if events[i][1] == "alloc":
            rank.setdefault(events[i][2], len(rank))
    return [events[i] for i in sorted(seq, key=lambda i: (events[i][0], events[i][3],
                                                          rank.get(events[i][2], -1) if events[i][1] == "free" else i))]


def renumber(raw: Raw) -> tuple[list[tuple[int, str, int]], dict[int, tuple[int, str, str]], list[SavedRecord],
                                list[tuple[str, int]]]:
    """Storage ids in allocation order (the tracer's own numbering: a storage's id is the number of storages
    registered before it), stand-in gradients as the copies' storages they stand for."""
    new: dict[Hashable, int] = {}
    for _, action, sid, _, _ in raw.events:
        if action == "alloc" and sid not in new:
            new[sid] = len(new)
    for sid, (_, target) in raw.standins.items():
        if target in new:
            new[sid] = new[target]
    events = [(op, action, new[sid]) for op, action, sid, _, _ in raw.events]
    meta = {new[sid]: m for sid, m in raw.meta.items() if sid in new and sid not in raw.standins}
    saved = [replace(s, storage=new[s.storage]) for s in raw.saved]
    retained = [(block, new[sid]) for block, sid in raw.retained]
    return events, meta, saved, retained

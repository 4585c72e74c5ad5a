"""What a real training forward allocates, storage by storage, seen by a `TorchDispatchMode` under
`FakeTensorMode` on CPU (no memory used): for checking `planner.memory.events` against real modules.

Each op output whose storage is new (not a view, not a parameter, buffer or batch tensor) is one allocation,
attributed to the block whose module runs (`tests.saved_tensors.block_of`); a storage is freed when its
`StorageWeakRef` expires (checked after every op: fake tensors die by reference counting, as real ones do).
Storages that autograd saves (saved_tensors_hooks) and parameter casts (`aten._to_copy` of a parameter:
autocast's cache) are flagged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import saved_tensors as st
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from planner.spec import ModelSpec, TrainConfig


@dataclass
class Alloc:
    key: int
    nbytes: int
    op: str
    block: str
    cast: bool = False  # a parameter's cast (autocast cache)
    saved: bool = False
    saved_by: str = ""  # the block running when autograd saved it
    freed_at: int | None = None  # index into Recording.allocs when it died


@dataclass
class Recording:
    allocs: list[Alloc] = field(default_factory=list)

    def block(self, name: str) -> list[Alloc]:
        return [a for a in self.allocs if a.block == name]

    def saved_by(self, name: str) -> list[Alloc]:
        """Storages autograd saved while block `name` ran (each once), in allocation order."""
        return [a for a in self.allocs if a.saved and a.saved_by == name]

    def transient_peak(self, name: str) -> int:
        """Peak bytes of storages allocated in block `name` that are neither saved nor casts, while it runs."""
        idx = [i for i, a in enumerate(self.allocs) if a.block == name]
        live = peak = 0
        for i in range(idx[0], idx[-1] + 1):
            a = self.allocs[i]
            if a.block == name and not a.saved and not a.cast:
                live += a.nbytes
            for j in range(idx[0], i + 1):
                b = self.allocs[j]
                if b.freed_at == i and b.block == name and not b.saved and not b.cast:
                    live -= b.nbytes
            peak = max(peak, live)
        return peak


class _Recorder(TorchDispatchMode):
    def __init__(self, spec: ModelSpec, stack: list[str], finished: set[str], excluded: set[int],
                 params: set[int]):
        super().__init__()
        self.spec, self.stack, self.finished, self.excluded, self.params = spec, stack, finished, excluded, params
        self.rec = Recording()
        self.refs: dict[int, tuple[StorageWeakRef, Alloc]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for k, (ref, a) in list(self.refs.items()):
            if ref.expired():
                a.freed_at = len(self.rec.allocs)
                del self.refs[k]
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o in outs:
            if not isinstance(o, torch.Tensor):
                continue
            s = o.untyped_storage()
            k = StorageWeakRef(s).cdata
            if k in self.excluded or k in self.refs:
                continue
            qual = self.stack[-1] if self.stack else ""
            blk = st.block_of(self.spec, qual, bool(self.finished & set(st.LOSS_AFTER)))
            cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
                and st._key(args[0]) in self.params
            a = Alloc(k, s.nbytes(), str(func), blk, cast)
            self.rec.allocs.append(a)
            self.refs[k] = (StorageWeakRef(s), a)
        return out


def record(spec: ModelSpec, config: TrainConfig) -> Recording:
    """One training forward + loss of `spec` under `config` (CPU kernels, FakeTensorMode, padded batch)."""
    from jobs.modeling import build_model, loss_of

    with torch._subclasses.fake_tensor.FakeTensorMode():
        module = build_model(spec.model_dump(mode="json"), config.attention, checkpointing=False)
        batch = st.make_batch(spec, config.batch_size, config.seq_len, True)
        params = {st._key(p) for p in module.parameters()}
        excluded = params | {st._key(b) for b in module.buffers()}
        excluded |= {st._key(v) for v in batch.values() if isinstance(v, torch.Tensor)}
        with st._module_tracker(module) as (stack, finished):
            rec = _Recorder(spec, stack, finished, excluded, params)

            def pack(t: torch.Tensor) -> torch.Tensor:
                # looked up while the storage is alive: a dead storage's key can be reused by a new one
                hit = rec.refs.get(st._key(t))
                if hit is not None and not hit[1].saved:
                    hit[1].saved = True
                    hit[1].saved_by = st.block_of(spec, stack[-1] if stack else "", bool(finished & set(st.LOSS_AFTER)))
                return t

            autocast = (torch.autocast("cpu", dtype=st.AUTOCAST_DTYPE[config.precision])
                        if config.precision in st.AUTOCAST_DTYPE else contextlib.nullcontext())
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec, autocast:
                loss_of(module, batch)
    return rec.rec

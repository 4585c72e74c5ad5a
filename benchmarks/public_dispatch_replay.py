"""Does op-level allocation order make the caching allocator hold far more than the allocated peak?

A check of one hypothesis for the public whole-GPU peaks the planner under-predicts (results/public/memory,
lambda-dlb-logs rows: nvidia-smi 30-31 GiB of a V100 32 GB, the planner 19-27 GiB). The planner's replay
(`planner.memory.reserved`) feeds the caching-allocator model a per-block trace (saved tensors, one
transient per block). Here the SAME allocator model (`planner.memory.allocator.replay`) gets every storage a
real Hugging Face module allocates and frees, op by op, over two training steps (forward, backward,
`optimizer.step()`, `zero_grad`), recorded by a `TorchDispatchMode` under `FakeTensorMode` on CPU (no memory
is used, any size runs): GEMM outputs, the scaled/masked scores, GELU and dropout intermediates, gradients
as autograd makes them, AdamW's foreach temporaries, in program order.

If the op-level replay's reserved/allocated stays near the planner's (a few %), fragmentation of this op
order under the allocator's rules does not explain the gap; if it is much larger, it does.

CPU kernels are not CUDA's (dropout masks are bool on both; CPU SDPA differs, so attention is eager here,
as in the public runs), the recording is torch of today (the public runs used torch 1.4). Prints one line
per configuration: allocated peak, reserved peak, ratio, and the planner's figures for the same row.

Usage: python benchmarks/public_dispatch_replay.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from planner.memory import allocator  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402

GIB = 2**30


class StorageRecorder(TorchDispatchMode):
    """Every new storage an op returns is an allocation; it is freed when its weak reference expires (checked
    after every op, before the op's own outputs are counted: autograd released it before the op ran). Events
    are (id, nbytes) / (id, 0), as `planner.memory.allocator` takes them; a storage of no bytes is none (CUDA
    allocates nothing for it). `cuda_dropout`: count CPU dropout's noise as CUDA's bool mask (see
    `record_steps`). Also the reference of tests/test_traced_two_steps.py."""

    def __init__(self, known: dict[int, StorageWeakRef] | set[int], cuda_dropout: bool = True):
        super().__init__()
        self.func = None
        self.events: list[tuple[int, int]] = []
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.known = known  # storages allocated before recording (parameters, batch): never re-counted
        self.next_id = 0
        self.cuda_dropout = cuda_dropout

    def add(self, s: torch.UntypedStorage) -> None:
        key = StorageWeakRef(s).cdata
        nbytes = int(s.nbytes())
        if key in self.known or key in self.live or nbytes <= 0:
            return
        self.next_id += 1
        self.live[key] = (StorageWeakRef(s), self.next_id)
        if self.cuda_dropout and self.func is torch.ops.aten.empty_like.default:  # CPU noise -> CUDA bool mask
            nbytes = max(nbytes // 4, 1)
        self.events.append((self.next_id, nbytes))

    def sweep(self) -> None:
        for key, (ref, tid) in list(self.live.items()):
            if ref.expired():
                self.events.append((tid, 0))
                del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sweep()
        self.func = func
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.add(o.untyped_storage())
        return out


OPTIONS = {"head": "sequence-classification", "num_labels": 2}  # the public rows' QA head, mapped


def record_steps(model_name: str, cfg: TrainConfig, steps: int = 2, set_to_none: bool = False):
    """Events of `steps` training steps of the catalog model (eager attention, fp32, AdamW foreach).

    CPU -> CUDA: CPU dropout keeps its noise as a tensor of the input's dtype (aten/src/ATen/native/Dropout.cpp
    `_dropout_impl`: `at::empty_like(input)` then `bernoulli_`), CUDA's fused kernel a bool mask
    (`native_dropout`, is_fused_kernel_acceptable): an `empty_like` storage is counted at 1 byte per element
    (fp32 here: nbytes / 4). Nothing else uses `empty_like` in this step (checked: its total at the peak equals
    the layers' three dropout masks)."""
    from jobs.modeling import build_model, loss_of
    from jobs.modeling import make_batch as probe_batch
    from planner.models.catalog import get_model

    spec = get_model(model_name, **OPTIONS)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        module = build_model(spec.model_dump(mode="json"), cfg.attention, checkpointing=False)
        batch = probe_batch(spec.model_dump(mode="json"), cfg.batch_size, cfg.seq_len, "cpu")
        opt = torch.optim.AdamW(module.parameters(), lr=0.0, foreach=True)
        known: dict[int, StorageWeakRef] = {}
        pre: list[tuple[int, int]] = []
        for i, t in enumerate([*module.parameters(), *module.buffers(),
                               *(v for v in batch.values() if isinstance(v, torch.Tensor))]):
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key not in known:
                known[key] = StorageWeakRef(t.untyped_storage())
                pre.append((-(i + 1), int(t.untyped_storage().nbytes())))
        rec = StorageRecorder(known)
        with rec:
            for _ in range(steps):
                loss = loss_of(module, batch)
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
                rec.sweep()
        return pre + rec.events


def planner_figures(model_name: str, cfg: TrainConfig, instance: str, stack: dict[str, str]) -> tuple[int, int]:
    import planner

    est = planner.estimate(model_name, cfg, instance, stack=stack, model_options=OPTIONS, with_throughput=False)
    return est.memory_bytes.peak_allocated, est.memory_bytes.peak_reserved


# zero_grad(set_to_none=...) of the recording -> a planner stack whose zero_grad() does the same (PR #92731)
STACKS = {False: {"torch": "1.13", "cuda": "11.7"}, True: {"torch": "2.4", "cuda": "12.1"}}

CASES = [  # (catalog model, batch, seq): the lambda-dlb-logs fp32 rows (fp32: no autocast mapping needed) and
    ("bert-large-uncased", 12, 384),  # the held-out RoBERTa-large at batch 1 and 8 (results/public/heldout)
    ("bert-base-uncased", 36, 384),
    ("roberta-large", 1, 128),
    ("roberta-large", 8, 128),
]
QUICK = [("bert-base-uncased", 4, 128)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small configuration only")
    args = ap.parse_args(argv)
    print("Op-level replay (every storage of 2 real training steps, FakeTensorMode, CPU kernels)")
    print("through planner.memory.allocator vs the planner's per-block replay; fp32, eager,")
    print("AdamW foreach; zg: zero_grad keeps the gradients (torch < 2.0) or frees them")
    print(f"{'model':<19}{'b':>3}{'s':>4}{'zg':>5}{'op alloc':>9}{'op resv':>8}{'ratio':>6}"
          f"{'pl alloc':>9}{'pl resv':>8}{'ratio':>6}")
    for name, b, s in QUICK if args.quick else CASES:
        cfg = TrainConfig(batch_size=b, seq_len=s, precision="fp32", attention="eager", parallelism="single")
        for set_to_none in (False, True):
            r = allocator.replay(record_steps(name, cfg, set_to_none=set_to_none))
            pa, pr = planner_figures(name, cfg, "ml.p3.2xlarge", STACKS[set_to_none])
            print(f"{name[:19]:<19}{b:>3}{s:>4}{'free' if set_to_none else 'keep':>5}"
                  f"{r.peak_allocated / GIB:>9.2f}{r.peak_reserved / GIB:>8.2f}"
                  f"{r.peak_reserved / r.peak_allocated:>6.3f}{pa / GIB:>9.2f}{pr / GIB:>8.2f}{pr / pa:>6.3f}")
    print("GiB; ratio = reserved / allocated; planner stacks: torch 1.13 (keep), 2.4 (free)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

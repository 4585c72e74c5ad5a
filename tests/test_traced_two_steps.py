"""A traced model's reserved peak comes from replaying its step twice (the first step, where the optimizer
states are made, then the steady one: planner.program.replay.run_events), with the training loop's lifetimes.

Checked against two real training steps of the same module: every storage an op makes and frees, recorded
by a TorchDispatchMode under FakeTensorMode (CPU kernels: the trace is taken with backend "cpu" so both
sides run the same kernels), replayed through the same allocator model. Sizes are chosen so that the
tensors are large-pool blocks (> 1 MiB) whose placement the first step decides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from planner.memory import allocator
from planner.memory.loops import LOOPS
from planner.program.replay import run_events
from planner.program.trace import trace_step
from planner.spec import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from public_dispatch_replay import StorageRecorder  # noqa: E402  (the op-level recorder the benchmark uses)

VOCAB, DIM = 4000, 256


class Net(nn.Module):
    """Embedding, two MLP blocks with residuals, an untied vocabulary head: logits of b·s·VOCAB fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                  nn.Linear(4 * DIM, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def batch(b: int, s: int):
    return {"input_ids": torch.randint(0, VOCAB, (b, s)), "labels": torch.randint(0, VOCAB, (b, s))}


def two_real_steps(loop: str, b: int, s: int) -> list[tuple[int, int]]:
    """Build, then two steps of `loop` (planner.memory.loops), every storage event in order."""
    rule = LOOPS[loop]
    with torch._subclasses.fake_tensor.FakeTensorMode():
        torch.manual_seed(0)
        module = Net().train()
        data = batch(b, s)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)
        pre = [(-(i + 1), p.untyped_storage().nbytes()) for i, p in enumerate(module.parameters())]
        known = {StorageWeakRef(t.untyped_storage()).cdata for t in (*module.parameters(), *data.values())}
        rec = StorageRecorder(known, cuda_dropout=False)
        with rec:
            out = None
            for _ in range(2):
                previous, out = out, module(**data)
                loss = out["loss"]
                del previous  # "next-forward": the previous outputs die when the name is rebound
                if rule.outputs_die == "forward-end":
                    out = None
                if rule.grads_die == "next-backward":
                    opt.zero_grad(set_to_none=True)
                    rec.sweep()
                loss.backward()
                del loss
                opt.step()
                if rule.grads_die == "step-end":
                    opt.zero_grad(set_to_none=True)
                if rule.outputs_die == "step-end":
                    out = None
                rec.sweep()
    return pre + rec.events


@pytest.mark.parametrize("loop", ["plain", "hf-trainer", "accelerate", "lightning"])
@pytest.mark.parametrize("b, s", [(4, 256), (8, 256)])
def test_two_step_replay_reserves_what_two_real_steps_reserve(loop, b, s):
    """Reserved equal to the byte. Allocated within 0.5 %: the tracer's frees inside one backward node
    come in another order than a weak-reference sweep sees them, which moves the allocated peak by a few
    blocks, not the segments. The steady-state-only order (states first) reserves another amount in most
    of these cases (126-230 MiB where two real steps reserve 128-242: it is what this replaced)."""
    cfg = TrainConfig(batch_size=b, seq_len=s, precision="fp32", loop=loop)
    trace = trace_step(Net, batch, cfg, loss_fn=lambda out, _: out["loss"], backend="cpu", periodic=False)
    evs, _ = run_events(trace, loop=loop)
    mine = allocator.replay(evs)
    real = allocator.replay(two_real_steps(loop, b, s))
    assert mine.peak_reserved == real.peak_reserved
    assert mine.peak_allocated == pytest.approx(real.peak_allocated, rel=0.005)


def test_every_storage_is_allocated_once_then_freed_once_and_the_steady_step_makes_no_states():
    cfg = TrainConfig(batch_size=2, seq_len=64, precision="fp32")
    trace = trace_step(Net, batch, cfg, loss_fn=lambda out, _: out["loss"], backend="cpu", periodic=False)
    evs, names = run_events(trace, loop="plain")
    live: set[int] = set()
    done: set[int] = set()
    for tid, n in evs:
        if n:
            assert tid not in live and tid not in done
            live.add(tid)
        else:
            assert tid in live
            live.discard(tid)
            done.add(tid)
    states = [n for t, n in evs if n and names[t] == "optimizer_state"]
    params = list(Net().parameters())
    # exp_avg and exp_avg_sq of each parameter, and (CPU) its step counter: made in the first step only
    assert sorted(states) == sorted([p.numel() * 4 for p in params] * 2 + [4] * len(params))
    assert {names[t] for t in live} == {"parameter", "optimizer_state"}  # the step's own all died
    # the steady step makes again every storage of the first but the states
    step = [n for t, n in evs if n and names[t] not in ("parameter", "buffer", "optimizer_state")]
    assert len(step) % 2 == 0 and sorted(step[: len(step) // 2]) == sorted(step[len(step) // 2:])

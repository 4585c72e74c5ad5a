"""Cross-entropy under autocast, as CUDA runs it: ATen's composite, not one fp32 loss.

CUDA autocast has no entry for `cross_entropy_loss` (ATen/autocast_mode.h AT_FORALL_FP32), so its composite
runs (aten/src/ATen/native/LossNLL.cpp): `log_softmax(self, dim, self.scalar_type())` keeps the logits' 16-bit
dtype (autocast's fp32_set_opt_dtype keeps an explicit dtype) and saves its output; nll_loss is on the fp32
list, so autocast gives it an fp32 copy of the log-probabilities, which it saves. CPU autocast differs: it has
cross_entropy_loss itself on its fp32 list (one fp32 log-softmax). The tracer emulates CUDA on CPU
(`trace.cuda_cross_entropy`); the analytic core says the same (`activations.cross_entropy_saved`); both are
checked here against each other and against the shared H200 readings' saved bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from planner.ir.context import Ctx
from planner.memory.activations import cross_entropy_saved, loss_transients
from planner.program import trace


def _saved_by(fn, *args):
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return saved, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_tracer_runs_cross_entropy_as_cuda_autocast_does(dtype):
    x = torch.randn(16, 50, requires_grad=True)
    w = torch.randn(50, 300, requires_grad=True)
    y = torch.randint(0, 300, (16,))
    with torch.autocast("cpu", dtype=dtype):
        cpu_saved, _ = _saved_by(lambda: F.cross_entropy(x @ w, y))
    with trace._cuda_autocast_fp32(), torch.autocast("cpu", dtype=dtype):
        cuda_saved, loss = _saved_by(lambda: F.cross_entropy(x @ w, y))
    # CPU autocast: one fp32 log-softmax (nll_loss saves the same storage again)
    assert {d for s, d in cpu_saved if s == (16, 300)} == {torch.float32}
    # CUDA: the 16-bit log-softmax and nll_loss's own fp32 copy of it
    assert [d for s, d in cuda_saved if s == (16, 300)] == [dtype, torch.float32]
    assert loss.dtype == torch.float32
    loss.backward()  # the emulated graph is a real one
    assert x.grad is not None and x.grad.shape == x.shape


def test_label_smoothing_keeps_cpu_autocast_whole_loss_cast():
    """The label-smoothing composite is not emulated (stated in `cuda_cross_entropy`): CPU's cast stands."""
    x = torch.randn(8, 40, requires_grad=True)
    y = torch.randint(0, 40, (8,))
    with trace._cuda_autocast_fp32(), torch.autocast("cpu", dtype=torch.bfloat16):
        saved, _ = _saved_by(lambda: F.cross_entropy(x.to(torch.bfloat16), y, label_smoothing=0.1))
    assert torch.bfloat16 not in {d for s, d in saved if s == (8, 40)}


def test_an_explicit_softmax_dtype_is_kept_under_the_emulation():
    """fp32_set_opt_dtype: only a missing dtype becomes fp32."""
    x = torch.randn(4, 10).to(torch.bfloat16)
    with trace._cuda_autocast_fp32(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.log_softmax(x, 1).dtype == torch.float32
        assert torch.log_softmax(x, 1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert F.softmax(x, dim=1, dtype=torch.bfloat16).dtype == torch.bfloat16


def _ctx(precision: str, backend: str = "cuda", composite: bool = True) -> Ctx:
    return Ctx(4, 8, precision, "sdpa", backend, False, cross_entropy_composite=composite)  # type: ignore[arg-type]


def test_the_analytic_rule_per_precision_backend_and_torch():
    n = 1000
    amp = cross_entropy_saved("loss", n, "bfloat16", _ctx("amp-bf16"))
    assert [(t.name, t.dtype) for t in amp] == [("loss.log_softmax", "bfloat16"),
                                                ("loss.nll_loss.input", "float32"), ("loss.total_weight", "float32")]
    for ctx in (_ctx("amp-bf16", backend="cpu"), _ctx("amp-bf16", composite=False), _ctx("fp32")):
        assert [(t.name, t.dtype) for t in cross_entropy_saved("loss", n, ctx.low, ctx)] == [
            ("loss.log_softmax", "float32"), ("loss.total_weight", "float32")]
    pure = cross_entropy_saved("loss", n, "bfloat16", _ctx("bf16"))
    assert {t.dtype for t in pure} == {"bfloat16"}


def test_loss_temporaries_follow_what_is_copied_and_saved():
    n = 4096
    ctx = _ctx("amp-bf16")
    fwd, bwd = loss_transients(cross_entropy_saved("loss", n, "bfloat16", ctx), ctx, upcast=False)
    assert (fwd, bwd) == (0, (4 * n,))  # no unsaved copy; nll_loss's fp32 gradient at the peak
    fp32 = _ctx("fp32")
    fwd, bwd = loss_transients(cross_entropy_saved("loss", n, "float32", fp32), fp32, upcast=False)
    assert (fwd, bwd) == (0, (4 * n, 4 * n))  # nll_loss's and log_softmax's gradients
    old = _ctx("amp-bf16", composite=False)
    fwd, bwd = loss_transients(cross_entropy_saved("loss", n, "bfloat16", old), old, upcast=False)
    assert (fwd, bwd) == (4 * n, (4 * n, 4 * n))  # the whole-loss fp32 copy, made and dropped in forward
    # ForCausalLMLoss's logits.float() on 16-bit logits: an unsaved copy before an fp32 loss
    fwd, _ = loss_transients(cross_entropy_saved("loss", n, "float32", ctx), ctx, upcast=True)
    assert fwd == 4 * n


def _shared_bert_rows():
    """(reading, its steps.jsonl row) for each BERT MLM step without checkpointing (`Reading.index` is the row)."""
    from planner.probes.readings import SHARED, load_steps

    rows = [json.loads(line) for line in (SHARED / "steps.jsonl").read_text().splitlines() if line.strip()]
    return [pytest.param(r, rows[r.index], id=r.label) for r in load_steps(SHARED)
            if r.model == "bert-base-uncased" and not r.config.checkpointing
            and "saved_bytes_nonparam" in rows[r.index].get("step1", {})]


@pytest.mark.parametrize(("reading", "row"), _shared_bert_rows())
def test_bert_mlm_saved_bytes_and_loss_peaks_match_the_h200(reading, row):
    """BERT-base MLM on the shared H200 (torch 2.11): the bytes packed for backward (activations and AMP weight
    casts, not parameters), the forward's peak, and how far backward rises above it (the measured rise is
    nll_loss's fp32 gradient under AMP and twice that in fp32: the loss's temporaries). Before the composite
    rule the saved bytes were 1 GB (the 16-bit n·V) short and the forward peak 0.9 GiB high at b32 × 512."""
    from planner.estimate import estimate

    est = estimate(reading.model, reading.config, reading.instance, stack=reading.stack or None)
    saved = est.to_json()["memory_bytes"]["activations"]
    assert saved == pytest.approx(row["step1"]["saved_bytes_nonparam"], rel=0.005)
    phase = {p.phase: p.allocated for p in est.phases}
    step2 = row["step2"]
    # what is left (13-86 MiB under, loss or not) is of a cuBLAS workspace's size: not the loss's n·V
    assert phase["forward"] == pytest.approx(step2["forward"]["max_alloc"], abs=96 * 2**20)
    rise = step2["backward"]["max_alloc"] - step2["forward"]["max_alloc"]
    assert phase["backward"] - phase["forward"] == pytest.approx(rise, rel=0.05, abs=64 * 2**20)


def test_the_stack_decides_the_composite():
    """torch >= 1.10 runs ATen's composite (`resolve.CROSS_ENTROPY_COMPOSITE_SINCE`); an older stack keeps the
    whole-loss fp32 rule, 2 bytes a logit fewer saved."""
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    cfg = TrainConfig(batch_size=4, seq_len=128, precision="amp-bf16", parallelism="single", attention="eager")
    new = estimate("bert-base-uncased", cfg, "ml.g5.xlarge", stack={"torch": "2.4"})
    old = estimate("bert-base-uncased", cfg, "ml.g5.xlarge", stack={"torch": "1.9"})
    logits = 4 * 128 * 30522
    assert new.memory_bytes.activations - old.memory_bytes.activations == pytest.approx(2 * logits, abs=4096)

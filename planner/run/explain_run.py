"""`planner explain` on a run of varying lengths: what raises the run's peak above one step's, and what
each usual fix would save, every figure computed again through the same run model (`simulate`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.run.simulate import RunRequest, with_fix
from planner.spec import Estimate
from planner.units import fmt_bytes

# "Capping the length": truncate every batch to this quantile of the run's padded lengths.
CAP_QUANTILE = 0.9
# "Bucketing": pad every batch up to one of this many equal-width lengths up to --seq-len.
BUCKETS = 4


def fixes(model: Any, est: Estimate, req: RunRequest, model_options: dict[str, Any] | None,
          extra: dict[str, Any] | None = None, *, estimate_fn: Callable[..., Estimate]
          ) -> list[tuple[str, int, Estimate]]:
    """(what, bytes saved on the run's reserved peak, the estimate with it), in the order tried.

    `estimate_fn` is planner.estimate.estimate, passed in by the explanation: the run model sits below the
    pipeline and never imports it (issue 33)."""
    estimate = estimate_fn

    run = est.run
    assert run is not None
    steps = with_fix(req, steps=run.steps)

    def again(r: RunRequest, stack=None) -> Estimate:
        return estimate(model, est.config, est.instance, model_options=model_options, stack=stack or est.stack,
                        with_throughput=False, run=r, **(extra or {}))

    tried: list[tuple[str, Estimate]] = []
    if not run.expandable_segments and est.stack is not None:
        conf = ",".join(x for x in (est.stack.alloc_conf, "expandable_segments:True") if x)
        tried.append(("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                      again(steps, est.stack.model_copy(update={"alloc_conf": conf}))))
    tried.append(("the longest batch first (one warm-up step at the longest length)",
                  again(with_fix(steps, order="longest-first"))))
    tried.append((f"bucketing: each batch padded up to a multiple of {-(-est.config.seq_len // BUCKETS)} tokens",
                  again(with_fix(steps, buckets=BUCKETS))))
    if not req.lengths.uniform and req.padding == "longest":
        tried.append(("group_by_length=True (--padding bucketed)", again(with_fix(steps, padding="bucketed"))))
    cap = _quantile_cap(est, steps)
    if cap < run.longest:
        tried.append((f"capping the length at {cap} tokens (the run's {CAP_QUANTILE:.0%} quantile; longer "
                      "batches truncated)", again(with_fix(steps, cap=cap))))
    return [(label, run.peak_reserved_bytes - alt.run.peak_reserved_bytes, alt) for label, alt in tried]


def _quantile_cap(est: Estimate, req: RunRequest) -> int:
    """The run's padded length at CAP_QUANTILE (of its steps, drawn again), rounded up to a multiple of 8."""
    from planner.run.simulate import plan

    padded = sorted(plan(req, est.config.batch_size, est.config.seq_len, req.steps or 1).padded)
    at = padded[min(int(CAP_QUANTILE * len(padded)), len(padded) - 1)]
    return -(-at // 8) * 8


def lines(model: Any, est: Estimate, req: RunRequest, model_options: dict[str, Any] | None,
          extra: dict[str, Any] | None = None, *, estimate_fn: Callable[..., Estimate]) -> list[str]:
    """The explain step of a run."""
    r = est.run
    if r is None:
        return []
    out = [f"{r.steps} steps of {r.lengths} (padding {r.padding}, seed {r.seed}), mean length "
           f"{r.mean_length:,.0f}, longest {r.longest}; each step replayed at its own length through the same "
           "caching allocator, nothing released between steps (no empty_cache).",
           f"The run reserves {fmt_bytes(r.peak_reserved_bytes)} at its peak, {fmt_bytes(r.growth_bytes)} "
           f"({r.growth_ratio:+.0%}) over one step at --seq-len {est.config.seq_len}: set at step {r.peak_step} "
           f"(length {r.peak_step_length}) by {r.peak_allocation or 'no new segment'}."]
    if r.growth_bytes > 0:
        out.append("Why: blocks cached for earlier, shorter shapes are split to their sizes; a longer batch "
                   "finds no free block large enough and the allocator reserves new segments, keeping the old.")
    if r.padding_waste is not None:
        out.append(f"Padding: {r.padding_waste:.0%} of the tokens computed are padding.")
    out.append("What each fix would save on the run's reserved peak (same steps, same model):")
    for label, saved, alt in fixes(model, est, req, model_options, extra, estimate_fn=estimate_fn):
        word = "saves" if saved >= 0 else "adds"
        out.append(f"- {label}: {word} {fmt_bytes(abs(saved))} (peak reserved "
                   f"{fmt_bytes(alt.run.peak_reserved_bytes)}; verdict {alt.verdict})")
    return out

"""The run flags of `estimate` and `explain` (`--lengths`, `--padding`, `--run-steps`, `--run-seed`) and the
lines that print a run: kept apart from the shared flags so the run's hooks into the commands stay small."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.spec import Estimate
from planner.units import fmt_bytes

LengthsOpt = Annotated[str | None, typer.Option(
    "--lengths", help="A run of varying lengths: uniform:MIN-MAX[:STEP] (each batch's padded length) or a "
                      "file of per-sample token lengths (.txt, .csv, .parquet, .npy).")]
PaddingOpt = Annotated[str | None, typer.Option(
    "--padding", help="With a length file: longest (random batches padded to their longest), bucketed "
                      "(grouped by length), max (padded to --seq-len), exact (each value is one "
                      "step's padded length, in order). Default longest.")]
RunStepsOpt = Annotated[int | None, typer.Option(
    "--run-steps", help="Steps to simulate (default: until the memory peak stops moving).")]
RunSeedOpt = Annotated[int | None, typer.Option("--run-seed", help="Seed of the run's draw of lengths "
                                                                   "(default 0).")]


def run_request(lengths: str | None, padding: str | None, run_steps: int | None, run_seed: int | None):
    """The run the flags ask for, or None (one step). Every run flag needs --lengths: without it the step is
    one step, and a flag that changes nothing is refused rather than ignored."""
    if lengths is None:
        from planner.errors import PlannerError

        for flag, value in (("--padding", padding), ("--run-steps", run_steps), ("--run-seed", run_seed)):
            if value is not None:
                raise PlannerError(flag, value, "only with --lengths (a run of varying lengths)")
        return None
    from planner.run.simulate import request

    req = request(lengths, padding=padding or "longest", steps=run_steps, seed=0 if run_seed is None else run_seed)
    if req.steps is not None and req.steps > SLOW_RUN_STEPS:
        from planner.cli.common import err_console

        err_console.print(f"note: --run-steps {req.steps:,} replays every step of the run, once for estimate and "
                          "again for each fix explain weighs: minutes on a 7B model (the default, until the "
                          "peak stops moving, takes seconds)", highlight=False, soft_wrap=True)
    return req


# Steps above which a run is said to be slow before it starts (issue 37). Measured on this project's 2-core
# machine: the replay costs ~0.1 ms per step per replay on BERT-base (estimate --run-steps 100000: 19 s) and
# more on a 7B model (explain of Llama-2-7B --run-steps 100000: over 400 s; 800 steps: 5 s).
SLOW_RUN_STEPS = 5_000


def run_lines(est: Estimate) -> list[str]:
    """The run in a few lines (none without one)."""
    r = est.run
    if r is None:
        return []
    steps = f"{r.steps} steps" + ("" if r.steps_converged else " (peak still moving: raise --run-steps)")
    lines = [f"Run: {r.lengths}, {steps}, mean length {r.mean_length:,.0f}, longest {r.longest}",
             f"  peak reserved {fmt_bytes(r.peak_reserved_bytes)} at step {r.peak_step} (length "
             f"{r.peak_step_length}),",
             f"  {fmt_bytes(r.growth_bytes)} ({r.growth_ratio:+.0%}) over one step at --seq-len "
             f"{est.config.seq_len}",
             f"  peak allocated {fmt_bytes(r.peak_allocated_bytes)}, on the device "
             f"{fmt_bytes(r.peak_device_bytes)}"]
    if r.padding_waste is not None:
        lines.append(f"  padding: {r.padding_waste:.0%} of the tokens computed are padding")
    if r.truncated_samples:
        lines.append(f"  {r.truncated_samples:,} samples longer than --seq-len truncated")
    if r.oom_after_retry:
        lines.append("  the run runs out of memory even after the allocator frees its cache")
    return lines

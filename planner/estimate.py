"""`planner.estimate`: one configuration in, the per-GPU memory by phase, the verdict, speed and cost out.

This module only runs the pipeline (planner.pipeline, ARCHITECTURE.md): resolve -> step (analytic or traced)
-> verdict, plus a run of varying lengths on top. Each term is a small function in `planner.memory`,
`planner.perf`. The pipeline's private names are re-exported here for callers that import them.
"""

from __future__ import annotations

from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.memory import timeline
from planner.pipeline.resolve import (  # noqa: F401  (re-exported: callers and tests import them from here)
    _resolve_instance,
    _resolve_model,
    _with_stack,
    check_supported,
    model_parallel_asked,
)
from planner.pipeline.step import (  # noqa: F401
    ACTIVATION_CACHE_SIZE,
    ACTIVATION_FIELDS,
    _activations,
    _block_memory,
    _prepare,
    _prepare_traced,
    _Prepared,
)
from planner.pipeline.verdict import _band_terms, _calibrated, _finish, _timeline_peaks  # noqa: F401
from planner.spec import (
    Estimate,
    Instance,
    ModelSpec,
    RuntimeConstants,
    SoftwareStack,
    TrainConfig,
)


def estimate(
    model: ModelSpec | str,
    config: TrainConfig,
    instance: Instance | str,
    *,
    runtime: RuntimeConstants | dict[str, Any] | None = None,
    backend: str = "cuda",
    model_options: dict[str, Any] | None = None,
    dataset_size: int | None = None,
    spot: bool = False,
    with_throughput: bool = True,
    expandable_segments: bool = False,
    inputs: str | None = None,
    loss: str | None = None,
    stack: SoftwareStack | dict[str, Any] | None = None,
    region: str | None = None,
    run: Any = None,
    calibration: dict[str, Any] | None = None,
) -> Estimate:
    """Per-GPU memory of one training step by phase, the OOM verdict, throughput and cost.

    `config.batch_size` is the micro-batch of one GPU. `runtime` overrides the GPU family's runtime
    constants (a RuntimeConstants or a dict of its fields). `peak_reserved` comes from replaying the step's
    tensors through the caching-allocator model (`planner.memory.reserved`) unless a fragmentation is given
    (explicit RuntimeConstants, a `fragmentation` override, or calibration): then allocated × (1 + it).
    `expandable_segments`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. A `model` of the form
    `file.py:build` is the user's own module, traced (`planner.program`) with `inputs` (`file.py:batch`) and
    `loss` (`file.py:fn`); so is a config.json whose model_type is none of the six hand-modelled families.
    `stack`: the software stack (a SoftwareStack or a dict with any of torch, cuda,
    transformers, alloc_conf; None = the DLC `probe launch` would use): it decides the CUDA context, the
    workspaces, `config.attention` "auto" and expandable segments. `verdict` comes from the band of the
    whole-device peak (`planner.memory.band`): `fits` only when its high end is under the GPU's memory.
    `region`: where the instance is priced (None: us-east-1); no price there leaves the cost out.
    `run`: a `planner.run.simulate.RunRequest` (--lengths): the run of varying lengths replayed step after
    step; `run` then holds its peaks and the verdict follows them (`planner.run.simulate.apply_run`).
    `calibration`: the calibration (`planner calibrate`'s JSON as a dict) this estimate uses; None reads
    results/calibration.json or $PLANNER_CALIBRATION (planner.memory.runtime.load_calibration), {} uses none.
    """
    from planner.models.user_module import is_reference, refuse_inputs_unless_own
    from planner.spec import MAX_DATASET_SIZE

    if is_reference(model) and inputs is None:  # before the tracer (and torch) load: seconds for one line
        raise PlannerError("--inputs", None, f"give --inputs FILE.py:FUNCTION (a batch(batch_size, seq_len) "
                           f"function) for --model {model}")
    from planner.program.sources import is_traced_config, require_tracing_libraries

    if dataset_size is not None and not 1 <= dataset_size <= MAX_DATASET_SIZE:
        raise PlannerError("--dataset-size", dataset_size, f"an integer >= 1 and <= {MAX_DATASET_SIZE:,} (2^53)")
    refuse_inputs_unless_own(model, inputs, loss)
    if is_reference(model) or is_traced_config(model):
        if run is not None:
            raise PlannerError("--lengths", run.lengths.text, "runs of varying length for catalog models and "
                               "config.json files of the modelled families (a traced module is one step)")
        require_tracing_libraries(str(model))
        prep = _prepare_traced(str(model), config, instance, runtime, backend, model_options, inputs, loss, stack,
                               calibration)
    else:
        if run is not None and model_parallel_asked(config):
            raise PlannerError("--lengths", run.lengths.text, "runs of varying length under data parallelism only "
                               "(with --tp/--cp/--pp the estimate is one step at --seq-len)")
        prep = _prepare(model, config, instance, runtime, backend, model_options, stack, calibration)
    est = _finish(prep, dataset_size, spot, with_throughput, expandable_segments, backend, region)
    if run is None:
        return est
    from planner.run.simulate import StepsAt, apply_run

    return apply_run(est, prep, run, StepsAt(prep, runtime, backend, model_options, stack, run_steps()),
                     expandable=expandable_segments or prep.stack.expandable_segments,
                     with_throughput=with_throughput, dataset_size=dataset_size, spot=spot)


def memory_timeline(model: ModelSpec | str, config: TrainConfig, instance: Instance | str, *,
                    runtime: RuntimeConstants | dict[str, Any] | None = None, backend: str = "cuda",
                    model_options: dict[str, Any] | None = None,
                    stack: SoftwareStack | dict[str, Any] | None = None) -> list[timeline.Point]:
    """The allocated bytes by category at each block of one step (what `--plot` draws)."""
    return timeline.simulate(_prepare(model, config, instance, runtime, backend, model_options, stack).step)


def clear_caches() -> None:
    """Forget every cached intermediate of one configuration (benchmarks of a cold start; tests): the tables
    of scope "step" (planner.caches). Per-model tables (kernel tables, blocks) and data files stay warm, as in
    a search; `planner.caches.clear()` empties those too."""
    from planner.memory import reserved  # noqa: F401  (its tables exist once it is imported)

    caches.clear("step")


def run_steps():
    """This pipeline's steps as a run repeats them at each length (planner.run.simulate.EstimateSteps)."""
    from planner.run.simulate import EstimateSteps

    return EstimateSteps(prepare=_prepare, calibrated=_calibrated, timeline_peaks=_timeline_peaks,
                         band_terms=_band_terms)


def program(model: ModelSpec | str, est: Estimate, *, model_options: dict[str, Any] | None = None,
            backend: str = "cuda", inputs: str | None = None, loss: str | None = None) -> dict[str, Any]:
    """`program.blocks[]` of `planner estimate --json` for an estimate `est` of `model`: its blocks' ops with
    their parameters, saved bytes, FLOPs, bytes moved and launches (planner.pipeline.program_report).
    Built on request only (a search never pays for it), from the estimate's resolved configuration."""
    from planner.models.user_module import is_reference
    from planner.program.sources import is_traced_config

    if is_reference(model) or is_traced_config(model):  # the trace lowered to a program (planner.program.lower)
        from planner.pipeline.program_report import traced_report

        prep = _prepare_traced(str(model), est.config, est.instance, None, backend, model_options, inputs, loss)
        return traced_report(prep.traced, prep.step.blocks, prep.traced.backend)
    from dataclasses import replace

    from planner.memory import framework_layout
    from planner.memory.parallel import sharding
    from planner.pipeline.program_report import program_report
    from planner.pipeline.resolve import FP8_COMPUTE, context, parallel_dims

    spec = _resolve_model(model, model_options)
    cfg = est.config  # resolved; --precision fp8 computes as FP8_COMPUTE with its Linears in FP8
    if cfg.precision == "fp8":
        cfg = cfg.model_copy(update={"precision": FP8_COMPUTE})
    dims = parallel_dims(spec, cfg, est.world_size) if est.parallel is not None else None
    ctx = context(spec, cfg, _resolve_instance(est.instance), backend, dims,
                  est.stack.torch if est.stack is not None else None)
    sixteen = framework_layout.layout(cfg).activation_precision
    if sixteen != cfg.precision:  # a 16-bit model without autocast saves what pure 16-bit training does, as the
        # memory model reads it (pipeline/step.py: Megatron, DeepSpeed, an FSDP mixed-precision policy)
        cfg, ctx = cfg.model_copy(update={"precision": sixteen}), replace(ctx, precision=sixteen)
    degree = est.parallel.dp_shard if est.parallel is not None else None  # model parallel: the DP shard group
    return program_report(spec, cfg, sharding(cfg, est.world_size, degree), ctx)

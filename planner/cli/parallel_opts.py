"""The model-parallel flags of estimate, explain, probe and search (issue 34): --tp, --sp, --cp, --pp,
--pp-schedule, --vp, --first-stage-layers / --last-stage-layers, --account-for-embedding / --account-for-loss and
--pp-layout (estimate and explain; issue 35), --dp-replicas, --distributed-optimizer, --grad-reduce-in-fp32, --recompute, --recompute-modules, and the
TrainConfig fields they set. How the degrees combine is checked once, when the estimate resolves the
configuration (planner.parallel.dims)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from planner.errors import PlannerError
from planner.spec import PIPELINE_SCHEDULES, RECOMPUTES

TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (GPUs splitting each layer's matmuls).")]
SpOpt = Annotated[bool | None, typer.Option(
    "--sp/--no-sp", help="Sequence parallelism with --tp (default: on when --tp > 1).", show_default=False)]
CpOpt = Annotated[int, typer.Option("--cp", help="Context-parallel degree (GPUs splitting the sequence).")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree (stages of layers).")]
PpScheduleOpt = Annotated[str | None, typer.Option(
    "--pp-schedule", help="Pipeline schedule: " + ", ".join(PIPELINE_SCHEDULES)
                          + " (default 1f1b; interleaved-1f1b with --vp).")]
VpOpt = Annotated[int, typer.Option("--vp", help="Virtual pipeline stages (model chunks) per pipeline rank.")]
FirstStageOpt = Annotated[int | None, typer.Option(
    "--first-stage-layers", help="Megatron: layers on the first pipeline stage (the rest split evenly).")]
LastStageOpt = Annotated[int | None, typer.Option(
    "--last-stage-layers", help="Megatron: layers on the last pipeline stage (the rest split evenly).")]
AccountEmbeddingOpt = Annotated[bool, typer.Option(
    "--account-for-embedding", help="Megatron: the embedding counts as a layer of the first stage.")]
AccountLossOpt = Annotated[bool, typer.Option(
    "--account-for-loss", help="Megatron: the loss counts as a layer of the last stage.")]
PpLayoutOpt = Annotated[str | None, typer.Option(
    "--pp-layout", help="Megatron: layers per pipeline stage as a layout, e.g. 'Et*3|(tt|)*29|L'.")]
DpReplicasOpt = Annotated[int | None, typer.Option(
    "--dp-replicas", help="HSDP: replica groups; states are sharded inside each group.")]
DistOptOpt = Annotated[bool, typer.Option(
    "--distributed-optimizer/--no-distributed-optimizer",
    help="Megatron's distributed optimizer: optimizer states sharded over data parallelism.")]
GradReduceOpt = Annotated[bool | None, typer.Option(
    "--grad-reduce-in-fp32/--no-grad-reduce-in-fp32",
    help="Megatron: main gradients kept and reduced in fp32 (default) or in bf16.", show_default=False)]
RecomputeOpt = Annotated[str | None, typer.Option(
    "--recompute", help="Activation recomputation: none, full (= --checkpointing) or selective.")]
RecomputeModulesOpt = Annotated[str | None, typer.Option(
    "--recompute-modules", help="With --recompute selective: Megatron's module names, e.g. core_attn,mlp.")]


def parallel_fields(*, tp: int = 1, sp: bool | None = None, cp: int = 1, pp: int = 1, pp_schedule: str | None = None,
                    vp: int = 1, dp_replicas: int | None = None, distributed_optimizer: bool = False,
                    grad_reduce_in_fp32: bool | None = None,
                    recompute: str | None = None, recompute_modules: str | None = None,
                    checkpointing: bool = False, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None, account_for_embedding: bool = False,
                    account_for_loss: bool = False, pp_layout: str | None = None) -> dict[str, Any]:
    """The TrainConfig fields of the flags (empty at their defaults). --checkpointing is --recompute full: the
    two may both be given only when they agree (TrainConfig keeps one answer, `recompute_mode`)."""
    for flag, value in (("--tp", tp), ("--cp", cp), ("--pp", pp), ("--vp", vp), ("--dp-replicas", dp_replicas)):
        if value is not None and value < 1:
            raise PlannerError(flag, value, "a positive integer")
    for flag, value in (("--first-stage-layers", first_stage_layers), ("--last-stage-layers", last_stage_layers)):
        if value is not None and value < 0:
            raise PlannerError(flag, value, "a number of layers, 0 or more")
    if pp_schedule is not None and pp_schedule not in PIPELINE_SCHEDULES:
        raise PlannerError("--pp-schedule", pp_schedule, ", ".join(PIPELINE_SCHEDULES))
    if recompute is not None and recompute not in RECOMPUTES:
        raise PlannerError("--recompute", recompute, ", ".join(RECOMPUTES))
    if checkpointing and recompute not in (None, "full"):
        raise PlannerError("--recompute", recompute, "full with --checkpointing (they are the same), or leave "
                           "--checkpointing out")
    modules = tuple(m.strip() for m in (recompute_modules or "").split(",") if m.strip())
    if modules and recompute != "selective":
        raise PlannerError("--recompute-modules", recompute_modules, "only with --recompute selective")
    given = {"tp": tp, "sp": sp, "cp": cp, "pp": pp, "pp_schedule": pp_schedule, "vp": vp, "dp_replicas": dp_replicas,
             "distributed_optimizer": distributed_optimizer, "grad_reduce_in_fp32": grad_reduce_in_fp32,
             "recompute": recompute, "recompute_modules": modules, "first_stage_layers": first_stage_layers,
             "last_stage_layers": last_stage_layers, "account_for_embedding": account_for_embedding,
             "account_for_loss": account_for_loss, "pp_layout": pp_layout}
    defaults = {"tp": 1, "sp": None, "cp": 1, "pp": 1, "pp_schedule": None, "vp": 1, "dp_replicas": None,
                "distributed_optimizer": False, "grad_reduce_in_fp32": None, "recompute": None,
                "recompute_modules": (), "first_stage_layers": None, "last_stage_layers": None,
                "account_for_embedding": False, "account_for_loss": False, "pp_layout": None}
    return {k: v for k, v in given.items() if v != defaults[k]}


def parallel_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's model-parallel layout (for the probe line)."""
    parts = [f"--{name} {getattr(config, name)}" for name in ("tp", "cp", "pp", "vp") if getattr(config, name) > 1]
    if config.sp is not None:
        parts.append("--sp" if config.sp else "--no-sp")
    if config.pp_schedule:
        parts.append(f"--pp-schedule {config.pp_schedule}")
    for name in ("first_stage_layers", "last_stage_layers"):
        if getattr(config, name, None) is not None:
            parts.append(f"--{name.replace('_', '-')} {getattr(config, name)}")
    for name in ("account_for_embedding", "account_for_loss"):
        if getattr(config, name, False):
            parts.append(f"--{name.replace('_', '-')}")
    if getattr(config, "pp_layout", None):
        parts.append(f"--pp-layout '{config.pp_layout}'")
    if config.dp_replicas:
        parts.append(f"--dp-replicas {config.dp_replicas}")
    if config.distributed_optimizer:
        parts.append("--distributed-optimizer")
    if getattr(config, "grad_reduce_in_fp32", None) is not None:
        parts.append("--grad-reduce-in-fp32" if config.grad_reduce_in_fp32 else "--no-grad-reduce-in-fp32")
    if config.recompute == "selective":
        parts.append("--recompute selective")
        if config.recompute_modules:
            parts.append("--recompute-modules " + ",".join(config.recompute_modules))
    return parts

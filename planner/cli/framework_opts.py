"""The --framework, --ds-config and --reshard-after-forward flags shared by estimate, explain, probe and search,
and the TrainConfig fields they set (`framework`, `deepspeed`, `reshard_after_forward`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from planner.errors import PlannerError
from planner.parallel.ds_config import STAGE_STRATEGY, read_ds_config
from planner.spec import FRAMEWORKS

FrameworkOpt = Annotated[str, typer.Option(
    "--framework", help="Whose layouts and defaults apply: " + ", ".join(FRAMEWORKS) + " (default pytorch: a "
                        "plain loop with autocast).")]
DsConfigOpt = Annotated[str | None, typer.Option(
    "--ds-config", help="DeepSpeed JSON config of the job (stage, bf16/fp16, bucket and prefetch sizes).")]

ReshardOpt = Annotated[bool | None, typer.Option(
    "--reshard-after-forward/--no-reshard-after-forward",
    help="FSDP: free each unit's gathered parameters after its forward (FULL_SHARD) or keep them until its "
         "backward (SHARD_GRAD_OP; torchtitan 'never'). Default: the framework's.", show_default=False)]


def reshard_fields(reshard_after_forward: bool | None) -> dict[str, Any]:
    """The TrainConfig field of --reshard-after-forward / --no-reshard-after-forward (empty when not given: the
    framework's default). Whether the job's strategy has it is checked once the parallelism is resolved
    (planner.memory.framework_layout.reshard_after_forward)."""
    return {} if reshard_after_forward is None else {"reshard_after_forward": bool(reshard_after_forward)}


def framework_fields(framework: str, ds_config: str | None, parallelism: str = "auto",
                     precision: str | None = None) -> dict[str, Any]:
    """The TrainConfig fields of --framework / --ds-config (empty for the defaults). A ds_config's stage sets an
    "auto" parallelism and must agree with a given one; its bf16/fp16 must agree with --precision."""
    from planner.parallel import known
    from planner.parallel.frameworks import get

    get(framework)  # an unknown framework: one line, exit 2
    out: dict[str, Any] = {}
    if framework != "pytorch":
        out["framework"] = framework
    if ds_config is None:
        return out
    if framework not in ("deepspeed", "accelerate", "lightning"):
        raise PlannerError("--ds-config", ds_config, "with --framework deepspeed, accelerate or lightning")
    ds = read_ds_config(ds_config)
    out["deepspeed"] = ds
    if ds.stage is not None:
        wanted = STAGE_STRATEGY[ds.stage]
        if parallelism == "auto":
            out["parallelism"] = wanted
        elif parallelism != wanted and not (ds.stage == 0 and getattr(known(parallelism), "uses_one_gpu", False)):
            raise PlannerError("--parallelism", parallelism,
                               f"{wanted} (the ds_config's zero_optimization.stage {ds.stage}), or leave it out")
    if ds.dtype and precision is not None and ds.dtype not in precision:
        raise PlannerError("--precision", precision, f"amp-{ds.dtype} or {ds.dtype} (the ds_config enables {ds.dtype})")
    return out


def framework_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's framework (for the probe line)."""
    parts = [] if config.framework == "pytorch" else [f"--framework {config.framework}"]
    if config.deepspeed is not None and config.deepspeed.source:
        parts.append(f"--ds-config {config.deepspeed.source}")
    if getattr(config, "reshard_after_forward", None) is not None:
        parts.append("--reshard-after-forward" if config.reshard_after_forward else "--no-reshard-after-forward")
    return parts

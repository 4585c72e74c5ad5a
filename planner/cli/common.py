"""What every command shares: error handling (one line, exit 2) and the `estimate` flags."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from planner.errors import FLAG_OF_FIELD, PlannerError, interrupted, one_line  # noqa: F401  (re-exported)


class _Console(Console):
    """A rich Console whose lines end where their text ends: rich pads wrapped lines and tables to the width,
    which leaves trailing spaces in every piped line (and in a file a user diffs)."""

    def _render_buffer(self, buffer: Any) -> str:
        text = super()._render_buffer(buffer)
        return "\n".join(line.rstrip(" ") for line in text.split("\n"))


console = _Console()
err_console = _Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def handles_errors(fn: F) -> F:
    """Bad input becomes `error: ...` on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from pydantic import ValidationError

        try:
            return fn(*args, **kwargs)
        except (PlannerError, ValidationError) as exc:
            err_console.print(f"[bold red]error:[/] {one_line(exc)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except BrokenPipeError:  # `planner ... --json | head`: the reader left; main.OneLineErrors ends quietly
            raise
        except OSError as exc:  # an unreadable or unwritable place the command did not check itself
            where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            err_console.print(f"[bold red]error:[/] {where}{exc.strerror or exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        # Ctrl-C, or a library's cleanup that turned it into its own error (planner.errors.interrupted)
        except (KeyboardInterrupt, Exception) as exc:
            if not interrupted(exc):
                raise
            err_console.print("interrupted; everything finished so far is saved")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


class InterruptedTrials(logging.Filter):
    """Drops Optuna's log of a trial that Ctrl-C stopped: `_run_trial` (optuna/study/_optimize.py) logs it
    as a warning with the whole traceback, then "Trial N failed with value None."; `handles_errors` says
    `interrupted` once instead. Other warnings pass."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KeyboardInterrupt) or "KeyboardInterrupt" in record.getMessage():
            self.interrupted = True
            return False
        return not (self.interrupted and "failed" in record.getMessage())


def quiet_interrupted_trials() -> None:
    """Install `InterruptedTrials` on Optuna's log handlers (they exist once optuna is imported)."""
    import optuna  # noqa: F401  (configures the "optuna" logger and its stderr handler)

    logger = logging.getLogger("optuna")
    for target in [*logger.handlers, logger]:
        if not any(isinstance(f, InterruptedTrials) for f in target.filters):
            target.addFilter(InterruptedTrials())


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


# ---- the flags of `planner estimate`, shared by explain, probe run and probe launch -------------
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Catalog name, path to a Hugging Face config.json, or FILE.py:build (your nn.Module).")]
InstanceOpt = Annotated[str, typer.Option("--instance", "-i", help="SageMaker instance type, e.g. ml.p3.16xlarge.")]
BatchOpt = Annotated[int | None, typer.Option("--batch-size", "-b", help="Micro-batch per GPU.")]
GlobalBatchOpt = Annotated[int | None, typer.Option("--global-batch-size",
                                                    help="Samples per optimizer step over all GPUs; sets --batch-size.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", "-s", help="Tokens per sample.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", "-p", help="fp32, amp-fp16, amp-bf16, fp16, bf16, fp8.")]
OptimizerOpt = Annotated[str, typer.Option(help="adamw, adam, sgd, sgd-momentum, adafactor, adamw-8bit.")]
OptimizerImplOpt = Annotated[str, typer.Option(help="foreach (PyTorch default), fused, for-loop.")]
ParallelismOpt = Annotated[str, typer.Option(help="auto, single, dp, ddp, zero1, zero2, zero3, fsdp.")]
CheckpointingOpt = Annotated[bool, typer.Option("--checkpointing/--no-checkpointing",
                                                help="Per-layer activation checkpointing.")]
AttentionOpt = Annotated[str, typer.Option(help="auto (the default kernel of transformers in the stack), eager, "
                                           "sdpa (memory-efficient), flash.")]
# The software stack (planner/data/stacks.json); unset = the DLC `probe launch` would use for the GPU.
TorchVersionOpt = Annotated[str | None, typer.Option("--torch-version", help="PyTorch X.Y (default: the DLC's).")]
CudaVersionOpt = Annotated[str | None, typer.Option("--cuda-version", help="CUDA X.Y of the torch build.")]
TransformersVersionOpt = Annotated[str | None, typer.Option("--transformers-version",
                                                            help="transformers X.Y (default: the newest).")]
AllocConfOpt = Annotated[str | None, typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF, e.g. "
                                                  "expandable_segments:True.")]


def stack_from_flags(torch_version: str | None, cuda_version: str | None, transformers_version: str | None,
                     alloc_conf: str | None) -> dict[str, str] | None:
    """The stack flags as the dict `estimate(stack=...)` takes; None when none was given."""
    given = {"torch": torch_version, "cuda": cuda_version, "transformers": transformers_version,
             "alloc_conf": alloc_conf}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


GradAccumOpt = Annotated[int, typer.Option("--grad-accum", help="Micro-steps per optimizer step.")]
InstancesOpt = Annotated[int, typer.Option("--instances", help="Number of instances (nodes).")]
Tf32Opt = Annotated[bool, typer.Option("--tf32/--no-tf32",
                                        help="fp32 matmuls on TF32 tensor cores (allow_tf32; Ampere and later; "
                                             "PyTorch's default is off).")]
ModelOptionOpt = Annotated[list[str] | None, typer.Option(
    "--model-option", "-o", help="Model option KEY=VALUE, e.g. tab_in=200 (multimodal-bert).")]
InputsOpt = Annotated[str | None, typer.Option(
    "--inputs", help="With --model FILE.py:build: FILE.py:batch, a batch(batch_size, seq_len) function.")]
LossOpt = Annotated[str | None, typer.Option(
    "--loss", help="With --model FILE.py:build: FILE.py:fn, fn(output, batch) -> loss (default: output.loss, "
                   "else the sum of the first output tensor).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def parse_model_options(items: list[str] | None) -> dict[str, Any]:
    """KEY=VALUE pairs; values that parse as int/float/bool become so."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise PlannerError("--model-option", item, "KEY=VALUE")
        key, raw = item.split("=", 1)
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        out[key.strip().replace("-", "_")] = value
    return out


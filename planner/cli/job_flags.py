"""The flags of `planner estimate` as one table, which `explain`, `search` and sweep files derive from.

A training job is described once, by `planner estimate`'s flags (its signature in `planner/cli/estimate_cmd.py`
is the source). `explain` takes exactly that signature (`same_flags`); `search` takes every flag it does not
already have under the same spelling (`search_takes`), as one value (fixed) or a list to explore; a sweep file
takes each at the YAML path in the table. A flag added to `estimate` later gets into all three by itself when
its name is a `TrainConfig` field (a fixed value in the search, `fixed.<name>` in a sweep); any other needs one
row in `PLACES` below, and tests/test_first_hour.py fails, naming the flag, until it has one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

import typer

# How the search and a sweep take each estimate flag that is not a TrainConfig field held fixed:
#   space:<SpaceSpec field>   one value fixes the dimension, a comma-separated list explores it
#   same                      the search has this flag itself (same spelling); the sweep path says where it goes
#   recipe / runtime          held for every trial; the sweep path says where
#   output                    what the command prints or writes, not part of the job (no sweep path)
PLACES: dict[str, tuple[str, str]] = {
    "model": ("same", "model"),
    "instance": ("same", "instance"),
    "model_option": ("same", "model_options"),
    "inputs": ("same", "inputs"),
    "loss": ("same", "loss"),
    "region": ("same", "region"),
    "dataset_size": ("same", "recipe.dataset_size"),
    "spot": ("same", "objective.spot"),
    "global_batch_size": ("same", "recipe.global_batch_size"),
    "seq_len": ("same", "recipe.seq_len"),
    "instances": ("same", "space.instance_counts"),
    "checkpointing": ("same", "space.checkpointing"),
    "torch_version": ("same", "stack.torch"),
    "cuda_version": ("same", "stack.cuda"),
    "transformers_version": ("same", "stack.transformers"),
    "alloc_conf": ("same", "stack.alloc_conf"),
    "json_out": ("output", ""),
    "plot": ("output", ""),
    "batch_size": ("space:batch_sizes", "space.batch_sizes"),
    "precision": ("space:precisions", "space.precisions"),
    "optimizer": ("space:optimizers", "space.optimizers"),
    "optimizer_impl": ("space:optimizer_impls", "space.optimizer_impls"),
    "parallelism": ("space:parallelisms", "space.parallelisms"),
    "attention": ("space:attentions", "space.attentions"),
    "grad_accum": ("space:grad_accums", "space.grad_accums"),
    "lora_r": ("space:lora_ranks", "space.lora_ranks"),
    "lora_targets": ("space:lora_target_sets", "space.lora_target_sets"),
    "base_dtype": ("space:base_dtypes", "space.base_dtypes"),
    "framework": ("space:frameworks", "space.frameworks"),
    "loop": ("space:loops", "space.loops"),
    "load": ("space:loads", "space.loads"),
    "ds_config": ("fixed", "fixed.ds_config"),  # the file is read when the search starts
    "lengths": ("recipe", "recipe.lengths"),
    "padding": ("recipe", "recipe.padding"),
    "run_steps": ("recipe", "recipe.run_steps"),
    "run_seed": ("recipe", "recipe.run_seed"),
    "cuda_context_mib": ("runtime", "runtime.cuda_context_mib"),
    "fragmentation": ("runtime", "runtime.fragmentation"),
}


@dataclass(frozen=True)
class JobFlag:
    """One `estimate` flag: its parameter, its spellings, and how the search and a sweep file take it."""

    name: str  # the parameter of `estimate` (a TrainConfig field where it is one)
    flags: tuple[str, ...]  # its option strings, e.g. ("--lora-r",) or ("--tf32", "--no-tf32")
    search: str  # see PLACES; "fixed" for a TrainConfig field held constant, "" when nothing places it
    sweep: str  # the YAML path ("space.lora_ranks", "fixed.tf32"); "" for output flags
    parameter: inspect.Parameter  # as `estimate` declares it (annotation with its typer.Option, default)

    @property
    def flag(self) -> str:
        return self.flags[0]


_ESTIMATE: list[Callable[..., Any]] = []  # the estimate command, once registered


def declare(estimate_command: Callable[..., Any]) -> None:
    """Record the estimate command whose signature is the table (planner/cli/estimate_cmd.py calls it)."""
    _ESTIMATE[:] = [estimate_command]


def _option(param: inspect.Parameter) -> Any:
    """The typer.Option inside a parameter's Annotated type."""
    if get_origin(param.annotation) is Annotated:
        for extra in get_args(param.annotation)[1:]:
            if isinstance(extra, typer.models.OptionInfo):
                return extra
    return None


def _spellings(param: inspect.Parameter) -> tuple[str, ...]:
    """The long option strings (`--lora-r`; `--tf32`, `--no-tf32`), as click will see them."""
    info = _option(param)
    decls = [info.default] if isinstance(getattr(info, "default", None), str) else []
    decls += list(getattr(info, "param_decls", ()) or ())
    out: list[str] = []
    for decl in decls:
        for part in str(decl).split("/"):
            if part.startswith("--"):
                out.append(part.strip())
    return tuple(out) or ("--" + param.name.replace("_", "-"),)


def job_flags() -> list[JobFlag]:
    """Every estimate flag with its place in the search and in a sweep file."""
    from planner.spec import TrainConfig

    if not _ESTIMATE:  # planner.cli.main registers estimate before the commands that derive from it
        raise RuntimeError("the estimate command is not registered yet (import planner.cli.main)")
    out = []
    for param in inspect.signature(_ESTIMATE[0], eval_str=True).parameters.values():
        search, sweep = PLACES.get(param.name) or (
            ("fixed", f"fixed.{param.name}") if param.name in TrainConfig.model_fields else ("", ""))
        out.append(JobFlag(param.name, _spellings(param), search, sweep, param))
    return out


def same_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(**flags)` with exactly the estimate command's flags (explain: the same job, explained)."""
    if not _ESTIMATE:
        raise RuntimeError("declare() the estimate command before deriving another from it")
    fn.__signature__ = inspect.signature(_ESTIMATE[0], eval_str=True)  # type: ignore[attr-defined]
    return fn


def _search_parameter(flag: JobFlag) -> inspect.Parameter:
    """The search's form of an estimate flag it lacks: the same spellings; None by default (not given).
    A space dimension takes text: one value fixes it, a list explores it."""
    info = _option(flag.parameter)
    help_text = getattr(info, "help", None) or ""
    if flag.search.startswith("space:"):
        field = flag.search.split(":", 1)[1]
        note = ("One value, or a list to explore (a,b). " if field != "lora_target_sets" else
                "One set fixes it; sets to explore are separated by ; (q_proj,v_proj;all-linear). ")
        annotation: Any = Annotated[str | None, typer.Option(*flag.flags, help=note + help_text)]
    else:
        kind = get_args(flag.parameter.annotation)[0] if get_origin(flag.parameter.annotation) is Annotated \
            else flag.parameter.annotation
        base = [t for t in get_args(kind) if t is not type(None)] or [kind]
        decl = "/".join(flag.flags) if len(flag.flags) == 2 and flag.flags[1].startswith("--no-") else flag.flags[0]
        annotation = Annotated[base[0] | None, typer.Option(decl, help=f"Held for every trial: {help_text}")]
    return inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def search_takes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add to the search command every estimate flag it does not have under the same spelling; `fn` gets
    them as `job={name: value}` (those given only)."""
    own = inspect.signature(fn, eval_str=True)
    spelled = {s for p in own.parameters.values() for s in _spellings(p)}
    added = [f for f in job_flags() if f.search not in ("same", "output", "") and not set(f.flags) & spelled
             and f.name not in own.parameters]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        job = {f.name: kwargs.pop(f.name) for f in added if kwargs.get(f.name) is not None}
        for f in added:
            kwargs.pop(f.name, None)
        return fn(**kwargs, job=job)

    params = [p for p in own.parameters.values() if p.name != "job"]
    wrapper.__signature__ = own.replace(parameters=[  # type: ignore[attr-defined]
        *[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params], *map(_search_parameter, added)])
    return wrapper


def sweep_updates(job: dict[str, Any], space: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """The estimate flags given to a search, as sweep updates: space texts go into `space` (the
    `--batch-sizes`-style dict; giving both spellings is bad input), the rest into {"fixed": ..., "recipe":
    ..., "runtime": ...} for `Sweep.with_overrides`."""
    from planner.errors import PlannerError

    table = {f.name: f for f in job_flags()}
    out: dict[str, dict[str, Any]] = {}
    for name, value in job.items():
        flag = table[name]
        if flag.search.startswith("space:"):
            field = flag.search.split(":", 1)[1]
            if space.get(field) is not None:
                raise PlannerError(flag.flag, value, f"one of {flag.flag} and --{field.replace('_', '-')}, "
                                   "not both")
            space[field] = str(value)
            continue
        section, _, key = flag.sweep.partition(".")
        out.setdefault(section, {})[key] = value
    return out

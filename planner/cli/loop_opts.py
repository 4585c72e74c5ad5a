"""The --loop / --load flags shared by estimate, explain, search and probe, and the TrainConfig fields they set
(the rules behind them: planner.memory.loops)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from planner.errors import PlannerError
from planner.memory.loops import DEFAULT_LOOP, LOAD_NAMES, LOOP_NAMES

LoopOpt = Annotated[str, typer.Option(
    "--loop", help="Training loop whose tensor lifetimes to assume: plain (zero_grad at the end, outputs held "
                   "to the end), hf-trainer, accelerate, lightning, or loss-only (outputs freed before "
                   "backward).")]
LoadOpt = Annotated[str, typer.Option(
    "--load", help="direct: the model is built in its training dtype; cast: built in fp32, then cast (the fp32 "
                   "segments stay reserved).")]


def check_loop(value: str, flag: str = "--loop") -> str:
    if value not in LOOP_NAMES:
        raise PlannerError(flag, value, ", ".join(LOOP_NAMES))
    return value


def check_load(value: str, flag: str = "--load") -> str:
    if value not in LOAD_NAMES:
        raise PlannerError(flag, value, ", ".join(LOAD_NAMES))
    return value


def loop_fields(loop: str, load: str) -> dict[str, Any]:
    """The TrainConfig fields of --loop and --load (empty at their defaults)."""
    out: dict[str, Any] = {}
    if check_loop(loop) != DEFAULT_LOOP:
        out["loop"] = loop
    if check_load(load) != "direct":
        out["load"] = load
    return out


def loop_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's loop and load (for the probe line)."""
    parts = []
    if config.loop != DEFAULT_LOOP:
        parts.append(f"--loop {config.loop}")
    if config.load != "direct":
        parts.append(f"--load {config.load}")
    return parts

"""The training loop and the load path as data: when each loop frees the model's outputs and the gradients,
and what building the model in fp32 before casting it leaves in the caching allocator.

Why: the same model and batch reserve different memory under different loops. A loop that keeps the model's
outputs (`out = model(**batch)`) until the step ends holds the logits through backward; one that returns only
the loss from a function frees them when the forward ends. A loop that calls `zero_grad(set_to_none=True)`
after `optimizer.step()` frees the gradients before the next forward; one that zeroes them later carries them
through it. `timeline._rows` and `events._record` read these rules; nothing else branches on a loop's name.

The batch dies with the step in every loop here (transformers' Trainer `del inputs` in `training_step`, but
its epoch iterator still holds the batch until the next one is fetched): it is a few MiB at most and is not
moved between loops.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.spec import Load, Loop

# When a loop frees what it holds: "forward-end" (before backward), "step-end" (after the optimizer step),
# "next-forward" (when the next step's forward returns and the name is rebound), "next-backward" (after the
# next step's forward, before its backward).
Moment = str


@dataclass(frozen=True)
class LoopRule:
    name: Loop
    outputs_die: Moment  # the model's outputs (logits)
    grads_die: Moment  # the gradients (`zero_grad(set_to_none=True)`)
    source: str
    # the framework returns the model's 16-bit outputs converted to fp32 under mixed precision
    outputs_to_fp32: bool = False


LOOPS: dict[str, LoopRule] = {r.name: r for r in (
    LoopRule("plain", "step-end", "step-end",
             "the shared GPU readings' loop (shared/gpu-readings/h200-2026-11-26/README.md): `out = model(**batch)`"
             " held until the step ends; backward; optimizer.step(); zero_grad(set_to_none=True)"),
    LoopRule("hf-trainer", "forward-end", "step-end",
             "transformers 5.24.0 trainer.py: compute_loss `outputs = model(**inputs)` (l. 2172) returns only the"
             " loss (l. 2217), so the outputs die before training_step's `accelerator.backward(loss)` (l. 2126);"
             " _inner_training_loop `self.optimizer.step()` (l. 1943) then `model.zero_grad()` (l. 1954),"
             " set_to_none by default since torch 2.0"),
    LoopRule("accelerate", "next-forward", "step-end",
             "huggingface/accelerate examples/nlp_example.py training_function: `outputs = model(**batch)`;"
             " `accelerator.backward(loss)`; `optimizer.step()`; `lr_scheduler.step()`; `optimizer.zero_grad()`:"
             " `outputs` is rebound only when the next forward returns. Under mixed precision"
             " Accelerator.prepare wraps the forward: `model.forward ="
             " convert_outputs_to_fp32(autocast_context(model_forward_func))` (accelerate 1.15 accelerator.py"
             " l. 1830; utils/operations.py ConvertOutputsToFp32), an fp32 copy of the 16-bit logits at the"
             " forward's end", outputs_to_fp32=True),
    LoopRule("lightning", "forward-end", "next-backward",
             "Lightning 2.x src/lightning/pytorch/loops/optimization/automatic.py: Closure.closure runs"
             " training_step (its outputs are locals: only the loss is returned), then zero_grad_fn"
             " (`_make_zero_grad_fn`: 'zeroes the gradients before back-propagation'), then backward_fn;"
             " optimizer.step(closure). The previous step's gradients live through the forward"),
    LoopRule("loss-only", "forward-end", "step-end",
             "a plain loop whose forward is a function returning only the loss, so the outputs die before"
             " backward: this project's benchmarks/gpu_session.py train_step (`out = loss_fn(model, batch)`,"
             " jobs/modeling.py loss_of) and jobs/probe.py; zero_grad(set_to_none=True) after optimizer.step()"),
)}
LOOP_NAMES: tuple[str, ...] = tuple(LOOPS)
LOAD_NAMES: tuple[str, ...] = ("direct", "cast")
DEFAULT_LOOP: Loop = "plain"


def rule(loop: Loop | str) -> LoopRule:
    return LOOPS[loop]


def build_ratio(load: Load | str, parameter_bytes: int) -> int:
    """How many bytes of the fp32 build stand behind each byte of a parameter stored in `parameter_bytes`
    bytes (0: nothing built first). `load == "cast"` builds every parameter in fp32 and casts it with
    `model.to(dtype)`: `Module._apply` makes the cast copy of each parameter, then `param.data = copy` frees the
    fp32 tensor (torch/nn/modules/module.py `_apply`), so the fp32 blocks become cached free blocks and the
    segments that held them stay reserved (no `torch.cuda.empty_cache()` in the loop). fp32 parameters are
    not cast: nothing to model."""
    if load != "cast" or parameter_bytes >= 4:
        return 0
    return 4 // parameter_bytes

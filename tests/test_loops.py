"""--loop and --load: the event trace agrees with the timeline under every loop, each loop frees what its
source says when it says, and the cast load leaves the fp32 build's segments reserved."""

from __future__ import annotations

import importlib

import pytest
import torch

from planner.memory import events, loops, timeline
from planner.memory.reserved import _build_trace, clear_caches
from planner.spec import TrainConfig

estimate_mod = importlib.import_module("planner.estimate")

CASES = [
    ("gpt2", dict(batch_size=2, seq_len=256, precision="amp-bf16")),
    ("bert-base-uncased", dict(batch_size=4, seq_len=128, precision="bf16", checkpointing=True)),
    ("gpt2", dict(batch_size=2, seq_len=128, precision="amp-fp16", grad_accum=2)),
]


def _prep(model, kw):
    return estimate_mod._prepare(model, TrainConfig(**kw), "ml.p4d.24xlarge", None, "cuda", None)


def _trace(prep, first_step=True):
    if first_step:
        return _build_trace(prep.spec, prep.cfg, prep.step, prep.activations, prep.share.parameters,
                            prep.share.gradients, prep.share.optimizer_states, "cuda")
    return events.step_events(prep.step, first_step=False)


@pytest.mark.parametrize("loop", loops.LOOP_NAMES)
@pytest.mark.parametrize("load", loops.LOAD_NAMES)
@pytest.mark.parametrize("model,kw", CASES)
@pytest.mark.parametrize("first_step", [True, False])
def test_trace_equals_the_timeline_under_every_loop_and_load(model, kw, loop, load, first_step):
    clear_caches()
    prep = _prep(model, {**kw, "loop": loop, "load": load})
    trace = _trace(prep, first_step)
    points = timeline.simulate(prep.step)
    assert [(m.phase, m.label) for m in trace.marks] == [(p.phase, p.label) for p in points]
    assert events.live_bytes(trace) == [p.total for p in points]


def _at(points, phase, label):
    return next(p for p in points if (p.phase, p.label) == (phase, label))


def test_each_loop_frees_outputs_and_gradients_when_its_source_says():
    by = {lp: timeline.simulate(_prep("gpt2", {**CASES[0][1], "loop": lp}).step) for lp in loops.LOOP_NAMES}
    retained = sum(b.retained_bytes for b in _prep("gpt2", CASES[0][1]).step.blocks)
    grads = sum(b.grad_bytes for b in _prep("gpt2", CASES[0][1]).step.blocks)
    assert retained > 0 and grads > 0
    opt = {lp: _at(p, "optimizer", "optimizer step").bytes["activations"] for lp, p in by.items()}
    # the Trainer and Lightning return only the loss: no logits at the optimizer step
    assert opt["plain"] - opt["hf-trainer"] == retained == opt["plain"] - opt["lightning"]
    first = {lp: _at(p, "forward", p[1].label) for lp, p in by.items()}
    # Accelerate's example loop still holds the previous step's outputs in the next forward
    assert first["accelerate"].bytes["activations"] - first["plain"].bytes["activations"] == retained
    # Accelerate's mixed precision converts the 16-bit outputs to fp32 at the forward's end (a transient)
    end = {lp: _at(p, "forward", "end of forward") for lp, p in by.items()}
    assert end["accelerate"].bytes["buffers"] - end["plain"].bytes["buffers"] == 2 * retained
    # Lightning zeroes the gradients after the forward: the previous step's live through it
    assert first["lightning"].bytes["gradients"] - first["plain"].bytes["gradients"] == grads


def test_cast_load_builds_fp32_first_and_its_segments_stay_reserved():
    kw = dict(batch_size=1, seq_len=128, precision="bf16")
    direct, cast = (estimate_mod.estimate("gpt2", TrainConfig(**kw, load=ld), "ml.p4d.24xlarge")
                    for ld in ("direct", "cast"))
    params = direct.memory_bytes.parameters
    points = timeline.simulate(_prep("gpt2", {**kw, "load": "cast"}).step)
    assert _at(points, "load", "fp32 build").bytes["parameters"] == 2 * params
    # the fp32 build (2x the bf16 parameters) is reserved and never given back in training
    assert cast.memory_bytes.peak_reserved >= 2 * params
    # (not necessarily more than direct: the cached fp32 blocks are reused by the gradients and states)
    # fp32 parameters are not cast: the same step
    amp = dict(batch_size=1, seq_len=128, precision="amp-bf16")
    a, b = (estimate_mod.estimate("gpt2", TrainConfig(**amp, load=ld), "ml.p4d.24xlarge").memory_bytes.peak_reserved
            for ld in ("direct", "cast"))
    assert a == b


def test_module_to_frees_each_fp32_parameter_after_its_copy():
    """What `loops.build_ratio` assumes of torch's `Module._apply`: the cast parameter is a new tensor and
    the fp32 one is released (no reference is kept), one parameter at a time."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    old = [p.data for p in model.parameters()]
    ptrs = [t.data_ptr() for t in old]
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.data_ptr() not in ptrs for p in model.parameters())
    assert loops.build_ratio("cast", 2) == 2 and loops.build_ratio("cast", 4) == 0
    assert loops.build_ratio("direct", 2) == 0


def test_explain_says_what_the_loop_and_load_change():
    from planner.explain import loop_lines

    kw = dict(batch_size=1, seq_len=128, precision="bf16")
    default = estimate_mod.estimate("gpt2", TrainConfig(**kw), "ml.g5.xlarge", with_throughput=False)
    assert loop_lines(default) == []
    other = estimate_mod.estimate("gpt2", TrainConfig(**kw, loop="lightning", load="cast"), "ml.g5.xlarge",
                                  with_throughput=False)
    text = " ".join(loop_lines(other))
    assert "Loop lightning" in text and "before its backward" in text and "built in fp32" in text


def test_search_space_takes_loops_and_loads_as_dimensions_or_fixed():
    from planner.hardware import get_instance
    from planner.search.space import SpaceSpec, parse_flag_list, resolve_space

    space = resolve_space(SpaceSpec(loops=("plain", "hf-trainer"), batch_sizes=(4,), seq_lens=(128,),
                                    precisions=("bf16",), checkpointing=(False,), parallelisms=("single",)),
                          "gpt2", get_instance("ml.g5.xlarge"), fixed={"load": "cast"})
    assert space.searched()["loop"] == ("plain", "hf-trainer")
    config = space.config({"instance": "ml.g5.xlarge", "loop": "hf-trainer", "optimizer_impl": "fused",
                           "attention": "sdpa"})
    assert (config.loop, config.load) == ("hf-trainer", "cast")
    assert parse_flag_list("loops", "plain,lightning") == ("plain", "lightning")
    with pytest.raises(Exception, match="--loop"):
        parse_flag_list("loops", "bogus")

"""Issue 38: a run of identical layers is traced as five (A, B, C and the last two) and the other layers are
written out as copies of C (`planner.program.periodic`). The written-out trace must be the whole model's,
field for field (ops, storage events in order with their ids, saved tensors, blocks), and the estimate JSON
the same byte for byte; where the layers do not repeat (a layer that differs, checkpointing) the tracer traces
the whole model."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from planner import caches
from planner.program import hf, periodic, sources, trace
from planner.program.trace import trace_step
from planner.spec import TrainConfig

DATA = Path(__file__).parent / "data"


def _tiny(arch: str, layers: int) -> dict:
    from transformers import BartConfig, Qwen2Config, T5Config

    if arch == "T5ForConditionalGeneration":
        cfg = T5Config(d_model=32, d_ff=64, num_layers=layers, num_heads=4, d_kv=8, vocab_size=64,
                       decoder_start_token_id=0)
    elif arch == "BartForConditionalGeneration":
        cfg = BartConfig(d_model=32, encoder_layers=layers, decoder_layers=layers - 1, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                         max_position_embeddings=64)
    else:
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    out = cfg.to_dict()
    out["architectures"] = [arch]
    return out


@pytest.fixture()
def cuts(monkeypatch):
    """The runs `periodic.expand` wrote out (name of the run's first layer, copies), and None for a fallback."""
    made: list[tuple[str, int] | None] = []
    real = periodic.expand

    def counted(raw, run):
        out = real(raw, run)
        made.append((run.kept[0], len(run.copies)) if out is not None else None)
        return out

    monkeypatch.setattr(periodic, "expand", counted)
    return made


def _both(config_dict: dict, cfg: TrainConfig, backend: str = "cuda"):
    hc = hf.hf_config_object(config_dict, "config.json", cfg.attention)
    kw = {"backend": backend, "enable_checkpointing": sources._checkpointing_for}
    cut = trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg, **kw)
    whole = trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg, periodic=False, **kw)
    return cut, whole


def _equal(a, b) -> None:
    for f in fields(a):
        assert getattr(a, f.name) == getattr(b, f.name), f.name


CASES = [  # (architecture, layers, batch, length, precision)
    ("T5ForConditionalGeneration", 8, 3, 8, "fp32"),
    ("T5ForConditionalGeneration", 7, 2, 16, "amp-bf16"),
    ("BartForConditionalGeneration", 8, 4, 8, "amp-fp16"),
    ("Qwen2ForCausalLM", 9, 2, 8, "bf16"),
    ("Qwen2ForCausalLM", 7, 3, 8, "amp-bf16"),
]


@pytest.mark.parametrize(("arch", "layers", "b", "s", "precision"), CASES)
def test_the_written_out_trace_is_the_whole_models(cuts, arch, layers, b, s, precision):
    cfg = TrainConfig(batch_size=b, seq_len=s, precision=precision, attention="sdpa")
    cut, whole = _both(_tiny(arch, layers), cfg)
    assert cuts and None not in cuts  # every run was cut and written out (no fallback to the whole model)
    assert sum(copies for _, copies in cuts) >= 2
    assert sum(e.action == "free" for e in whole.events) > 0 and whole.saved  # the comparison covers something
    _equal(cut, whole)


@pytest.mark.parametrize(("path", "layers_cut"), [("t5-base.json", 2 * 6), ("bart-base.json", 2),
                                                   ("qwen2-0.5b.json", 19)])
def test_published_configs_at_a_small_shape(cuts, path, layers_cut):
    """The benchmark's models themselves (T5-base: 11 identical layers after the first in each stack)."""
    raw = json.loads((DATA / path).read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    cut, whole = _both(raw, TrainConfig(batch_size=2, seq_len=8, precision="bf16" if "qwen" in path else "fp32",
                                        attention="sdpa"))
    assert None not in cuts and sum(copies for _, copies in cuts) == layers_cut
    _equal(cut, whole)


def test_checkpointing_and_different_layers_trace_the_whole_model(cuts):
    """Under checkpointing nothing is cut (a layer's recomputation runs before autograd names its block); the
    answer is the whole trace either way."""
    cfg = TrainConfig(batch_size=2, seq_len=8, checkpointing=True, attention="sdpa")
    cut, whole = _both(_tiny("Qwen2ForCausalLM", 8), cfg)
    assert cuts == []
    _equal(cut, whole)


def test_a_run_is_only_identical_layers():
    """T5's first layer holds the relative attention bias: the run starts at layer 1; an attribute that holds a
    layer's own position in every layer (`layer_idx`) is no difference, one equal to it by chance is
    (Qwen2-0.5B's num_key_value_groups, 7, in layer 7)."""
    cfg = hf.hf_config_object(_tiny("T5ForConditionalGeneration", 9), "config.json", "sdpa")
    with torch.device("meta"):
        model = hf.model_class(cfg)(cfg)
    runs = periodic.find_runs(model, lambda n: trace.block_of(n, trace.layer_repeats(model)))
    assert [(r.kept, r.copies) for r in runs] == [
        (tuple(f"{s}.block.{i}" for i in (1, 2, 3, 7, 8)), [f"{s}.block.{i}" for i in (4, 5, 6)])
        for s in ("encoder", "decoder")]
    model.decoder.block[5].layer[0].dropout.p = 0.2  # one layer differs: the decoder's run stops before it
    runs = periodic.find_runs(model, lambda n: trace.block_of(n, trace.layer_repeats(model)))
    assert [r.kept[0] for r in runs] == ["encoder.block.1"]


def test_the_estimate_is_the_same_byte_for_byte(monkeypatch, tmp_path, cuts):
    from planner.estimate import estimate

    monkeypatch.setenv("PLANNER_TRACE_CACHE", "0")
    path = tmp_path / "qwen2.json"
    path.write_text(json.dumps(_tiny("Qwen2ForCausalLM", 8)))
    cfg = TrainConfig(batch_size=3, seq_len=16, precision="amp-bf16", attention="sdpa")
    caches.clear()
    cut = estimate(str(path), cfg, "ml.g5.xlarge").model_dump(mode="json")
    assert cuts and None not in cuts
    caches.clear()
    monkeypatch.setattr(trace, "PERIODIC_LAYERS", False)
    whole = estimate(str(path), cfg, "ml.g5.xlarge").model_dump(mode="json")
    caches.clear()
    assert json.dumps(cut, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_code_that_needs_every_layer_is_traced_whole(cuts, monkeypatch):
    """A forward that indexes its layers up to a count of its own fails on the cut model: traced whole."""

    class Indexed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                              for _ in range(7))

        def forward(self, x):
            for i in range(7):
                x = self.layers[i](x)
            return x

    truncated: list[str] = []
    real = periodic.truncate
    monkeypatch.setattr(periodic, "truncate", lambda run: truncated.append(run.kept[0]) or real(run))
    cfg = TrainConfig(batch_size=2, seq_len=4)
    cut = trace_step(Indexed, lambda b, s: torch.randn(b, s, 8), cfg, backend="cpu")
    whole = trace_step(Indexed, lambda b, s: torch.randn(b, s, 8), cfg, backend="cpu", periodic=False)
    assert truncated == ["layers.0"] and cuts == []  # cut, raised (IndexError) before anything was written out
    _equal(cut, whole)

    class Iterated(Indexed):
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    cut = trace_step(Iterated, lambda b, s: torch.randn(b, s, 8), cfg, backend="cpu")
    assert cuts == [("layers.0", 2)]  # the same layers, iterated: cut and written out
    _equal(cut, trace_step(Iterated, lambda b, s: torch.randn(b, s, 8), cfg, backend="cpu", periodic=False))

"""Matmul FLOPs per block vs torch.utils.flop_counter.FlopCounterMode on real (small) transformers modules.

The modules are the catalog architectures with shrunk sizes, built from config dicts with random weights
(eager attention: on CPU, SDPA runs a kernel FlopCounterMode does not count).
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count  # noqa: E402

from planner.models import hf_config  # noqa: E402
from planner.models.catalog import get_model  # noqa: E402
from planner.perf import flops  # noqa: E402
from planner.spec import Component, DenseSpec, ModelSpec, TrainConfig  # noqa: E402

VOCAB = 503
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL = {
    "bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=VOCAB),
    "roberta": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                    vocab_size=VOCAB),
    "distilbert": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=96, vocab_size=VOCAB),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, **TOKENS),
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=160, vocab_size=VOCAB, **TOKENS),
    "mistral": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=160, vocab_size=VOCAB, sliding_window=None, **TOKENS),
}
CASES = [
    ("bert-base-uncased", {}), ("bert-base-uncased", {"num_labels": 3}), ("bert-base-uncased", {"head": "base"}),
    ("roberta-base", {}), ("roberta-base", {"num_labels": 5}),
    ("distilbert-base-uncased", {}), ("distilbert-base-uncased", {"num_labels": 3}),
    ("gpt2", {}), ("gpt2", {"num_labels": 3}),
    ("llama-2-7b", {}), ("llama-3-8b", {"num_labels": 4}), ("mistral-7b", {}),
]
BATCH, SEQ = 2, 24
LAYER_MODULE = re.compile(r"\.(?:layer|h|layers)\.(\d+)$")  # encoder.layer.3, transformer.h.3, model.layers.3


def small_spec(name: str, options: dict) -> ModelSpec:
    t = get_model(name, **options).transformers[0]
    return hf_config.spec_from_hf_config({**t.hf_config, **SMALL[t.family]}, name=name)


def build(spec: ModelSpec):
    t = spec.transformers[0]
    cfg = {k: v for k, v in t.hf_config.items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    return getattr(transformers, t.architecture)._from_config(config, attn_implementation="eager")


def measure(module, checkpointing: bool) -> tuple[int, int, dict]:
    """(forward, backward incl. recompute, per-module forward FLOPs) as FlopCounterMode counts them."""
    module.train()
    if checkpointing:
        module.activation_checkpointing_enable()  # transformers 5 default: non-reentrant
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with counter:
        out = module(input_ids=ids, attention_mask=torch.ones_like(ids))
        fwd = counter.get_total_flops()
        per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        tensors = [out.logits] if hasattr(out, "logits") else [out.last_hidden_state]
        if getattr(out, "pooler_output", None) is not None:
            tensors.append(out.pooler_output)
        sum(x.float().sum() for x in tensors).backward()
    return fwd, counter.get_total_flops() - fwd, per_module


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_step_flops_match_flop_counter(name, options, checkpointing):
    spec = small_spec(name, options)
    fwd, bwd, per_module = measure(build(spec), checkpointing)
    ours = flops.step_flops(spec, TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager",
                                              checkpointing=checkpointing))
    assert ours.forward == fwd
    assert ours.backward + ours.recompute == bwd
    # per block: each transformer layer's forward equals what the counter attributes to that module
    layers = {b.name.rsplit(".", 1)[-1]: b.forward for b in ours.blocks if b.role == "layer"}
    counted = {m.group(1): v for k, v in per_module.items() if (m := LAYER_MODULE.search(k))}
    assert counted and counted == layers


def test_fused_attention_backward_matches_torch_sdpa_formula():
    """SDPA/flash backward recomputes Q@K^T: torch's sdpa_backward count = our 2x forward + recompute."""
    spec = small_spec("llama-2-7b", {})
    t = spec.transformers[0]
    q = (BATCH, t.num_heads, SEQ, t.head_dim)
    kv = (BATCH, t.num_kv_heads, SEQ, t.head_dim)
    attn_fwd = flops.attention_score_flops(t, BATCH, SEQ)
    assert attn_fwd == sdpa_flop_count(q, kv, kv)
    sdpa = flops.step_flops(spec, TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="sdpa"))
    eager = flops.step_flops(spec, TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager"))
    per_layer_recompute = (sdpa.recompute - eager.recompute) // t.num_layers
    assert 2 * attn_fwd + per_layer_recompute == sdpa_backward_flop_count(q, q, kv, kv)


def test_dense_block_matches_linear():
    spec = ModelSpec(name="mlp", components=(Component(name="tab", layers=(DenseSpec(in_features=37, out_features=11),)),))
    layer = torch.nn.Linear(37, 11)
    x = torch.randn(5, 37, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        y = layer(x)
        fwd = counter.get_total_flops()
        y.sum().backward()
    ours = flops.step_flops(spec, TrainConfig(batch_size=5, seq_len=1))
    assert ours.forward == fwd and ours.backward == counter.get_total_flops() - fwd


def test_causal_fraction_halves_only_the_attention_term():
    spec = small_spec("gpt2", {})
    t = spec.transformers[0]
    cfg = TrainConfig(batch_size=BATCH, seq_len=SEQ, attention="eager")
    full, half = flops.step_flops(spec, cfg), flops.step_flops(spec, cfg, causal_fraction=0.5)
    assert full.forward - half.forward == t.num_layers * flops.attention_score_flops(t, BATCH, SEQ) // 2

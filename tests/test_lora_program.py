"""LoRA and QLoRA as a transform of the program (planner.ir.transforms.lora_layers; issue 33 item 4).

- `planner estimate --json`'s program under LoRA / QLoRA sums to the memory terms on one GPU, as without
  adapters: its `param_bytes` to `memory_bytes.parameters`, its `saved_bytes` to `.activations` (the memory
  model reads the same transformed program: planner.adapters.activations);
- the transformed program's parameter tensors are peft's: `inject_adapter_in_model` on the real module
  (lora_A / lora_B per targeted Linear or Conv1D, named as `named_parameters()` names them);
- a 4-bit base reads a `dequantize` op per quantized Linear and saves no weight cast;
- frozen Linears save no input; the blocks before the first adapter save nothing.
What the transformed program saves is checked against real peft modules' saved-tensor hooks in
tests/test_lora_activations.py (the memory model's numbers are the program's).
"""

from __future__ import annotations

import pytest

from planner.adapters.activations import adapters_of, lora_program
from planner.adapters.lora import plan
from planner.ir.context import Ctx
from planner.memory.op_saved import op_saved, weight_cast
from planner.models.catalog import get_model
from planner.spec import TrainConfig

BASE = {"batch_size": 4, "seq_len": 128, "precision": "amp-bf16", "parallelism": "single"}
RUNS = {"lora": {"lora_r": 16}, "qlora": {"lora_r": 16, "base_dtype": "nf4"},
        "all-linear-ckpt": {"lora_r": 8, "checkpointing": True, "lora_targets": ("all-linear",)},
        "fp32-dropout": {"lora_r": 8, "lora_dropout": 0.1, "precision": "fp32"},
        "bf16-base": {"lora_r": 8, "base_dtype": "bf16", "lora_dropout": 0.05}}


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "roberta-base"])
@pytest.mark.parametrize("run", list(RUNS))
def test_estimate_program_sums_to_the_memory_terms_under_lora(name, run):
    from planner.estimate import estimate, program

    cfg = TrainConfig(**(BASE | RUNS[run]))
    est = estimate(name, cfg, "ml.p4d.24xlarge", with_throughput=False)
    ops = [op for b in program(name, est)["blocks"] for op in b["ops"]]
    assert sum(op["param_bytes"] for op in ops) == est.memory_bytes.parameters
    assert sum(op["saved_bytes"] for op in ops) == est.memory_bytes.activations
    assert any(op["kind"] == "scale" for op in ops)
    assert any(op["kind"] == "dequantize" for op in ops) == (run == "qlora")


def _program(name, **kw):
    spec = get_model(name)
    cfg = TrainConfig(**(BASE | kw))
    ctx = Ctx(cfg.batch_size, cfg.seq_len, cfg.precision, "sdpa", "cuda", False)
    lora = plan(spec, cfg)
    return spec, cfg, ctx, lora, lora_program(spec, cfg, lora, ctx)


def test_a_4bit_base_dequantizes_every_quantized_linear_and_casts_none():
    spec, cfg, ctx, lora, program = _program("llama-3-8b", lora_r=16, base_dtype="nf4")
    adapters = adapters_of(spec, cfg, lora)
    layer = program.block("model.layer.0")
    linears = [op for op in layer.ops if op.kind == "linear" and not op.attrs.get("adapter")]
    assert len(linears) == 7 == sum(op.kind == "dequantize" for op in layer.ops)
    assert all(not weight_cast(op, ctx) for op in linears)
    assert len(adapters.quantized) == 7 * 32
    # the adapters' own weights are fp32 and cast under autocast (lora_B always; lora_A where x needs a grad)
    assert any(weight_cast(op, ctx) for op in layer.ops if op.attrs.get("adapter"))


def test_frozen_linears_save_no_input_and_blocks_before_the_first_adapter_nothing():
    spec, cfg, ctx, lora, program = _program("gpt2", lora_r=8, lora_targets=("c_attn",))
    assert program.block("model.embeddings").ops and all(
        not op_saved(op, ctx) for op in program.block("model.embeddings").ops)
    layer = program.block("model.layer.3")
    frozen = [op for op in layer.ops if op.kind == "linear" and op.attrs.get("frozen")]
    assert [op.name for op in frozen] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert all(not op_saved(op, ctx) for op in frozen)
    assert [op.name for op in layer.ops if op.attrs.get("adapter")] == [
        "attn.c_attn.lora_A", "attn.c_attn.lora_B", "attn.c_attn.lora_scale"]


@pytest.mark.parametrize("family,targets", [("llama", ("q_proj", "v_proj")), ("gpt2", ("all-linear",)),
                                            ("bert", ("query", "value", "output.dense"))])
def test_the_adapter_parameters_are_peft_s(family, targets):
    """The transformed program's parameter tensors, names and shapes, are those of the real module with
    peft's adapters injected (`inject_adapter_in_model`, adapter name "default")."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from tests import saved_tensors as st

    spec = st.model(family, layers=2, hidden=64, heads=4, vocab=100)
    cfg = TrainConfig(batch_size=2, seq_len=16, lora_r=4, lora_targets=targets)
    ctx = Ctx(2, 16, "fp32", "sdpa", "cpu", True)
    program = lora_program(spec, cfg, plan(spec, cfg), ctx)
    from jobs import modeling

    module = modeling.build_model(spec.model_dump(mode="json"), device="meta")
    module = st.inject_lora(module, targets, 0.0)
    real = sorted((n, tuple(p.shape)) for n, p in module.named_parameters())
    ours = sorted((p.name, p.shape) for p in program.params)
    assert ours == real
    assert sum("lora_" in n for n, _ in ours) > 0


@pytest.mark.parametrize("family,precision,targets,dropout", [("gpt2", "amp-bf16", ("all-linear",), 0.1),
                                                              ("bert", "fp32", ("query", "value"), 0.0)])
def test_saved_in_the_order_the_module_saves(family, precision, targets, dropout):
    """The transformed program's saved storages of a layer, in program order, are the real peft module's
    in the order its saved-tensor hooks see them (the adapters' own in exactly that order, interleaved with the
    base's; the whole sequence equal too when the harness saw the same storages: in a long test session it
    once missed one, keyed by a reused address) (the old records appended the adapters' tensors at the
    block's end, which moved the allocator replay's reserved peak: tests/estimate_snapshot.py change 5).
    The frozen base's AMP weight casts are left out: the memory model keeps them as their own term."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from planner.adapters.activations import lora_activations
    from planner.memory.activations import activation_blocks
    from tests import saved_tensors as st

    spec = st.model(family, layers=2, hidden=64, heads=4, vocab=100)
    cfg = TrainConfig(batch_size=2, seq_len=16, precision=precision, attention="sdpa", lora_r=4,
                      lora_targets=targets, lora_dropout=dropout)

    measured = st.measure(spec, cfg, fake=False, transform=lambda m: st.inject_lora(m, targets, dropout))
    block = "model.layer.1"
    real = [(t.nbytes, "lora_" in t.module) for t in measured.tensors
            if t.block == block and not (t.weight_cast and "lora_" not in t.module)]
    records = tuple(activation_blocks(spec, cfg, backend="cpu"))
    ours = next(r for r in lora_activations(spec, cfg, records, plan(spec, cfg), backend="cpu") if r.block == block)
    from planner.memory.activations import _ctx

    ctx = _ctx(cfg, "cpu", spec.inputs.attention_mask, True)
    ops = lora_program(spec, cfg, plan(spec, cfg), ctx).block(block).ops
    mine = [(t.nbytes, bool(op.attrs.get("adapter"))) for op in ops
            for t in (weight_cast(op, ctx) if op.attrs.get("adapter") else []) + op_saved(op, ctx)]
    assert [n for n, _ in mine] == [t.nbytes for t in ours.tensors]  # the memory model's records are these
    # the adapters' own tensors, in the module's order (dropout mask, lora_A's weight cast and input, lora_B's)
    assert [n for n, lora in mine if lora] == [n for n, lora in real if lora]
    # interleaved with the base's, as the module saves them (not all at the block's end, as the old records)
    first = next(i for i, (_, lora) in enumerate(mine) if lora)
    assert any(not lora for _, lora in mine[first:]) and any(not lora for _, lora in real[first:])
    if sorted(mine) == sorted(real):  # the whole sequence (the harness keys storages by address: see st.measure)
        assert mine == real

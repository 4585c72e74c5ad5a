"""Saved-activation formulas (planner.memory.activations) against what autograd really saves.

The expected value is always a measurement (`tests/saved_tensors.measure`: saved-tensor hooks on the real
transformers / jobs.modeling module under FakeTensorMode), never a number from our own output.

This machine has no GPU, so the measurements are of CPU kernels and the comparisons use
`backend="cpu"`. The CUDA backend differs only through named functions (dropout masks, LayerNorm /
BatchNorm statistics, autocast fp32 lists, the SDPA kernel choice, the fused kernels' logsumexp and bias
padding, allocator rounding); `test_cuda_*` below assert each of those differences explicitly, and
`test_cuda_differs_from_cpu_only_in_named_functions` checks that switching the backend changes nothing
else in a layer.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.memory import activations as act  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402
from tests.saved_tensors import measure, model, multimodal  # noqa: E402

TOLERANCE = 0.05  # relative; the formulas aim to be exact
ERRORS: list[tuple[float, str]] = []


@pytest.fixture(scope="module", autouse=True)
def _report_worst(request):
    yield
    if ERRORS:
        worst, case = max(ERRORS)
        line = f"\nactivations: {len(ERRORS)} cases, worst |error| {100 * worst:.3f} % ({case})"
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(line)


def check(spec, config: TrainConfig, *, padded: bool = True, fake: bool = True) -> None:
    """Prediction (backend="cpu") within TOLERANCE of the measurement, in total and for every block."""
    measured = measure(spec, config, padded=padded, fake=fake, keep_tensors=False)
    blocks = act.activation_blocks(spec, config, "cpu", padded=padded)
    predicted = {b.block: b.kept_total_bytes for b in blocks}
    total = sum(predicted.values())
    err = abs(total - measured.total) / measured.total
    case = (f"{spec.name} b={config.batch_size} s={config.seq_len} {config.precision} {config.attention} "
            f"ckpt={config.checkpointing} padded={padded}")
    ERRORS.append((err, case))
    assert err <= TOLERANCE, f"{case}: measured {measured.total} predicted {total}"
    for name in set(predicted) | set(measured.per_block):
        m, p = measured.per_block.get(name, 0), predicted.get(name, 0)
        assert abs(p - m) <= TOLERANCE * max(m, 1), f"{case} block {name}: measured {m} predicted {p}"
    casts = {b.block: b.weight_cast_bytes for b in blocks if not b.checkpointed and b.weight_cast_bytes}
    assert casts == {k: v for k, v in measured.weight_cast.items() if v}, case
    assert sum(b.autocast_cache_bytes for b in blocks) == measured.cast_cache, case  # weights + biases


PRECISIONS = ("fp32", "amp-bf16", "bf16")
FAMILIES = {
    "bert": ("bert", "sequence-classification", {}),
    "roberta": ("roberta", "sequence-classification", {}),
    "distilbert": ("distilbert", "sequence-classification", {}),
    "gpt2-lm": ("gpt2", "causal-lm", {}),
    "llama-lm": ("llama", "causal-lm", {"kv_heads": 2, "intermediate": 176}),  # GQA, SwiGLU, RMSNorm
}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("b,s", [(1, 13), (3, 37)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_families(family, b, s, precision, attention, checkpointing):
    fam, head, kw = FAMILIES[family]
    check(model(fam, head, **kw), TrainConfig(batch_size=b, seq_len=s, precision=precision, attention=attention,
                                               checkpointing=checkpointing))


HEADS_AND_KERNELS = {
    "bert-mlm": ("bert", "masked-lm", {}),
    "roberta-mlm": ("roberta", "masked-lm", {}),
    "distilbert-mlm": ("distilbert", "masked-lm", {}),
    "gpt2-cls": ("gpt2", "sequence-classification", {}),
    "llama-cls": ("llama", "sequence-classification", {"kv_heads": 2}),
    # no attention dropout: CPU SDPA takes its flash kernel (saves q, k, v, out, logsumexp, bias)
    "bert-no-dropout": ("bert", "sequence-classification", {"attention_probs_dropout_prob": 0.0,
                                                            "hidden_dropout_prob": 0.0}),
    "gpt2-no-attn-dropout": ("gpt2", "causal-lm", {"attn_pdrop": 0.0}),  # fused kernel on the c_attn views
    "llama-attn-dropout": ("llama", "causal-lm", {"kv_heads": 2, "attention_dropout": 0.1}),  # math + GQA
    "distilbert-relu": ("distilbert", "sequence-classification", {"activation": "relu"}),
    "gpt2-gelu-tanh": ("gpt2", "causal-lm", {"activation_function": "gelu_pytorch_tanh"}),
    "roberta-no-cls-dropout": ("roberta", "sequence-classification", {"classifier_dropout": 0.0}),
}


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", list(HEADS_AND_KERNELS))
def test_heads_and_kernels(case, precision, attention):
    fam, head, kw = HEADS_AND_KERNELS[case]
    check(model(fam, head, **kw), TrainConfig(batch_size=2, seq_len=19, precision=precision, attention=attention,
                                               checkpointing=case.endswith("mlm")))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_amp_fp16(family, attention):
    kw = {"kv_heads": 2} if family == "llama" else {}
    check(model(family, "sequence-classification" if family == "bert" else None, **kw),
          TrainConfig(batch_size=2, seq_len=21, precision="amp-fp16", attention=attention))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("text,binary", [("bert", True), ("bert", False), ("distilbert", True), ("roberta", False)])
def test_multimodal(text, binary, precision, checkpointing):
    spec = multimodal(text, binary=binary)
    for attention in ("eager", "sdpa"):
        check(spec, TrainConfig(batch_size=3, seq_len=23, precision=precision, attention=attention,
                                checkpointing=checkpointing))


@pytest.mark.slow
@pytest.mark.parametrize("precision,attention", [("fp32", "eager"), ("amp-fp16", "sdpa"), ("bf16", "sdpa")])
def test_full_size_bert_base(precision, attention):
    """bert-base-uncased's real config (12 layers, hidden 768, vocab 30522) at b=8, s=512."""
    check(model("bert", "sequence-classification", full=True),
          TrainConfig(batch_size=8, seq_len=512, precision=precision, attention=attention))


@pytest.mark.slow
def test_full_size_multimodal():
    check(multimodal("bert", full=True), TrainConfig(batch_size=4, seq_len=128, precision="amp-bf16",
                                                     attention="sdpa", checkpointing=True))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_fake_counts_match_a_real_run(family):
    """FakeTensorMode counts equal real CPU tensors' counts byte for byte, per block and per storage."""
    spec = model(family, "sequence-classification" if family == "bert" else None,
                 **({"kv_heads": 2} if family == "llama" else {}))
    for cfg in (TrainConfig(batch_size=2, seq_len=11, precision="amp-bf16", attention="eager"),
                TrainConfig(batch_size=2, seq_len=11, precision="fp32", attention="sdpa", checkpointing=True)):
        fake, real = measure(spec, cfg), measure(spec, cfg, fake=False)
        assert fake.total == real.total > 0
        assert fake.per_block == real.per_block
        assert [(t.shape, t.dtype, t.nbytes) for t in fake.tensors] == [(t.shape, t.dtype, t.nbytes)
                                                                        for t in real.tensors]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_unpadded_batch(family, precision):
    """No padding: HF passes SDPA no mask (is_causal / enable_gqa for decoders). Real tensors, because
    under FakeTensorMode HF cannot prove a decoder batch unpadded and always builds the mask."""
    spec = model(family, "sequence-classification" if family == "bert" else None,
                 **({"kv_heads": 2} if family == "llama" else {}))
    for ckpt in (False, True):
        check(spec, TrainConfig(batch_size=2, seq_len=9, precision=precision, attention="sdpa", checkpointing=ckpt),
              padded=False, fake=False)


@pytest.mark.slow
@pytest.mark.parametrize("window", [8, 4096])
def test_mistral_sliding_window(window):
    """Mistral: like Llama, plus an explicit mask once s >= sliding_window, even without padding."""
    spec = model("mistral", "causal-lm", kv_heads=2, sliding_window=window)
    for precision in ("amp-bf16", "bf16"):
        cfg = TrainConfig(batch_size=2, seq_len=13, precision=precision, attention="sdpa")
        check(spec, cfg)
        check(spec, cfg, padded=False, fake=False)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_pure_fp16(family, attention):
    kw = {"kv_heads": 2} if family == "llama" else {}
    check(model(family, "sequence-classification" if family == "bert" else None, **kw),
          TrainConfig(batch_size=2, seq_len=21, precision="fp16", attention=attention, checkpointing=True))


def test_flash_needs_16_bit():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError):
        act.activation_blocks(model("bert"), TrainConfig(batch_size=1, seq_len=8, attention="flash"))


# -------------------------------------------------------------------------------- CUDA differences


def _layer(spec, config, backend, **kw) -> act.BlockActivations:
    return next(b for b in act.activation_blocks(spec, config, backend, **kw) if b.block.endswith("layer.0"))


def _tensors(block):
    return {t.name: t for t in block.tensors}


def test_cuda_dropout_saves_a_bool_mask():
    """native_dropout on CUDA saves a 1-byte mask; the CPU path saves a noise tensor of x's dtype (what
    the CPU measurements contain); p == 0 saves nothing."""
    assert act.dropout_saved("d", 1000, "float32", 0.1, "cuda") == [act.Saved("d", 1000, "bool")]
    assert act.dropout_saved("d", 1000, "bfloat16", 0.1, "cpu")[0].nbytes == 2000
    assert act.dropout_saved("d", 1000, "float32", 0.0, "cuda") == []


def test_cuda_differs_from_cpu_only_in_named_functions():
    """Same BERT layer (fp32, eager) on both backends: identical tensors except dropout masks (bool on
    CUDA) — the CPU version of which is checked against measurements above."""
    spec, cfg = model("bert", "sequence-classification", hidden=128), TrainConfig(batch_size=4, seq_len=64,
                                                                                  attention="eager")
    cpu, cuda = _tensors(_layer(spec, cfg, "cpu")), _tensors(_layer(spec, cfg, "cuda"))
    assert cpu.keys() == cuda.keys()
    for name, t in cpu.items():
        expected = "bool" if "dropout_mask" in name else t.dtype
        assert cuda[name] == act.Saved(name, t.numel, expected)


def test_cuda_sdpa_saves_no_quadratic_tensor():
    """On CUDA, SDPA (memory-efficient with a mask, flash without) keeps no b·a·s² tensor; eager does."""
    spec = model("bert", "sequence-classification", hidden=128, heads=4)
    b, s, a = 4, 256, 4
    for padded in (True, False):
        for precision in ("fp32", "amp-fp16", "bf16"):
            cfg = TrainConfig(batch_size=b, seq_len=s, precision=precision, attention="sdpa")
            layer = _layer(spec, cfg, "cuda", padded=padded)
            assert max(t.numel for t in layer.tensors) < b * a * s * s
            eager = _layer(spec, cfg.model_copy(update={"attention": "eager"}), "cuda", padded=padded)
            assert max(t.numel for t in eager.tensors) == b * a * s * s


def test_cuda_sdpa_kernel_choice():
    ctx = act.Ctx(2, 64, "amp-bf16", "sdpa", "cuda", padded=False)
    assert act.sdpa_kernel(ctx, "bfloat16", 0.1, masked=False, head_dim=64) == "flash"
    assert act.sdpa_kernel(ctx, "bfloat16", 0.1, masked=True, head_dim=64) == "efficient"
    assert act.sdpa_kernel(ctx, "float32", 0.1, masked=False, head_dim=64) == "efficient"
    v100 = act.Ctx(2, 64, "amp-fp16", "sdpa", "cuda", padded=False, flash_ok=False)
    assert act.sdpa_kernel(v100, "float16", 0.1, masked=False, head_dim=64) == "efficient"
    cpu = act.Ctx(2, 64, "fp32", "sdpa", "cpu", padded=True)
    assert act.sdpa_kernel(cpu, "float32", 0.1, True, 64) == "math"  # measured: CPU flash refuses dropout
    assert act.sdpa_kernel(cpu, "float32", 0.0, True, 64) == "cpu_flash"


def test_cuda_efficient_attention_padding():
    """logsumexp rows padded to 32 (kAlignLSE), the bias's last dim to a multiple of 8 (preprocess_mask)."""
    spec = model("bert", "sequence-classification", hidden=128, heads=4)
    t = _tensors(_layer(spec, TrainConfig(batch_size=3, seq_len=37, attention="sdpa"), "cuda", padded=True))
    assert t["attention.logsumexp"] == act.Saved("attention.logsumexp", 3 * 4 * 64, "float32")
    assert t["attention.bias"] == act.Saved("attention.bias", 3 * 37 * 40, "float32")
    cpu = _tensors(_layer(spec, TrainConfig(batch_size=3, seq_len=37, attention="sdpa"), "cpu", padded=True))
    assert "attention.bias" not in cpu  # CPU training with dropout: math path, mask added in place


def test_cuda_autocast_fp32_ops():
    """CUDA autocast runs softmax, layer_norm and pow in fp32 (CPU keeps them 16-bit, as measured), and
    CUDA norms keep fp32 statistics."""
    bert = model("bert", "sequence-classification")
    cfg = TrainConfig(batch_size=2, seq_len=16, precision="amp-bf16", attention="eager")
    cuda, cpu = _tensors(_layer(bert, cfg, "cuda", padded=False)), _tensors(_layer(bert, cfg, "cpu", padded=False))
    assert (cuda["attention.softmax"].dtype, cpu["attention.softmax"].dtype) == ("float32", "bfloat16")
    pure = TrainConfig(batch_size=2, seq_len=16, precision="bf16", attention="eager")
    stats = _tensors(_layer(bert, pure, "cuda"))["output.LayerNorm.mean"]
    assert stats.dtype == "float32"
    gpt2 = model("gpt2", "causal-lm")
    g_cuda, g_cpu = _tensors(_layer(gpt2, cfg, "cuda")), _tensors(_layer(gpt2, cfg, "cpu"))
    assert (g_cuda["mlp.act.x_for_pow"].dtype, g_cpu["mlp.act.x_for_pow"].dtype) == ("float32", "bfloat16")


def test_cuda_allocator_rounding():
    spec = model("bert", "sequence-classification")
    layer = _layer(spec, TrainConfig(batch_size=1, seq_len=3), "cuda")
    assert layer.saved_bytes == sum(-(-t.nbytes // 512) * 512 for t in layer.tensors)
    assert act.alloc_bytes(1, "cpu") == 1


def test_korthikanti_count_for_16bit_eager_bert():
    """Korthikanti et al. 2022: 34·s·b·h + 5·a·s²·b bytes per layer for 16-bit eager attention with
    dropout. Our CUDA BERT layer in pure fp16 is exactly that plus fp32 LayerNorm statistics (2 norms ×
    mean and rstd × n × 4 bytes)."""
    b, s, h, a = 8, 512, 768, 12
    spec = model("bert", "sequence-classification", full=True)
    layer = _layer(spec, TrainConfig(batch_size=b, seq_len=s, precision="fp16", attention="eager"), "cuda")
    assert layer.saved_bytes == 34 * s * b * h + 5 * a * s * s * b + 2 * 2 * b * s * 4


def test_checkpointing_keeps_layer_inputs_and_recomputes_casts():
    spec = model("bert", "sequence-classification")
    cfg = TrainConfig(batch_size=2, seq_len=16, precision="amp-fp16", checkpointing=True, attention="sdpa")
    blocks = act.activation_blocks(spec, cfg, "cuda", padded=False)
    layers = [b for b in blocks if ".layer." in b.block]
    assert all(b.checkpointed and b.kept_bytes < b.saved_bytes and b.kept_total_bytes == b.kept_bytes
               for b in layers)
    assert not any(b.checkpointed for b in blocks if ".layer." not in b.block)
    assert act.saved_activation_bytes(spec, cfg, "cuda", padded=False) == sum(b.kept_total_bytes for b in blocks)
    assert blocks[-1].block == "loss"


def test_identical_layers_share_one_record_renamed():
    """Layers of one spec (other than the first) get the first one's record under their own name: every field
    equal to a full `dataclasses.replace` copy, the tensors included (they are not compared by `==`)."""
    import dataclasses

    from planner.models.catalog import cached_model

    blocks = act.activation_blocks(cached_model("bert-base-uncased"), TrainConfig(batch_size=2, seq_len=64,
                                                                                   precision="amp-fp16"))
    layers = [b for b in blocks if ".layer." in b.block]
    assert len(layers) == 12 and len({b.block for b in layers}) == 12
    for b in layers[2:]:
        full = dataclasses.replace(layers[1], block=b.block)
        assert all(getattr(b, f.name) == getattr(full, f.name) for f in dataclasses.fields(full))

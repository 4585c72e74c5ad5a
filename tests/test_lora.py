"""LoRA / QLoRA against real peft and bitsandbytes: trainable and frozen counts as peft counts them, every
device byte of a 4-bit base as bitsandbytes stores it, and the dtypes peft gives adapters.

Catalog models are built on the meta device (shapes only). The 4-bit checks quantize small real models on the
CPU (bitsandbytes 0.50 quantizes on CPU): shapes chosen so that blocks of 64 and of 256 do not divide evenly.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from planner.adapters import nf4  # noqa: E402
from planner.adapters.lora import plan  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.models import hf_config  # noqa: E402
from planner.models.catalog import get_model  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402
from tests.test_params import hf_module  # noqa: E402

TASK = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}


def _config(**lora) -> TrainConfig:
    return TrainConfig(batch_size=1, seq_len=8, **lora)


def _peft_model(module, spec, targets, r=8):
    task = TASK.get(spec.transformers[0].head)
    if targets == ("all-linear",):
        target_modules = "all-linear"
    else:
        target_modules = list(targets) or None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(module, peft.LoraConfig(r=r, lora_alpha=16, target_modules=target_modules,
                                                           task_type=task))


CASES = [(name, head, targets)
         for name in ("llama-2-7b", "mistral-7b", "gpt2", "bert-base-uncased", "roberta-base")
         for head in (None, "sequence-classification")
         for targets in (("all-linear",), ())]
CASES += [("llama-3-8b", None, ("q_proj", "k_proj", "v_proj", "o_proj")), ("gpt2-medium", None, ("c_proj",)),
          ("distilbert-base-uncased", None, ("all-linear",)), ("distilbert-base-uncased", None, ("q_lin", "v_lin")),
          ("bert-base-uncased", None, ("dense",))]


@pytest.mark.parametrize("name,head,targets", CASES)
def test_counts_match_peft(name, head, targets):
    """peft's own `get_nb_trainable_parameters` (trainable, all) on the real class vs the plan, for default
    targets, all-linear (GPT-2's Conv1D included, output head left out) and named targets."""
    spec = get_model(name, **({"head": head} if head else {}))
    model = _peft_model(hf_module(dict(spec.transformers[0].hf_config)), spec, targets)
    trainable, everything = model.get_nb_trainable_parameters()
    p = plan(spec, _config(lora_r=8, lora_targets=targets))
    assert (p.trainable, p.frozen) == (trainable, everything - trainable)
    shapes = [tuple(t.shape) for t in model.parameters() if t.requires_grad]
    assert sorted(p.shapes) == sorted(shapes)


def test_rank_scales_adapters_only():
    spec = get_model("llama-2-7b")
    a, b = (plan(spec, _config(lora_r=r, lora_targets=("q_proj", "v_proj"))) for r in (8, 64))
    assert b.trainable == 8 * a.trainable and a.frozen == b.frozen


def test_unknown_target_names_flag():
    with pytest.raises(PlannerError, match="--lora-targets.*q_prj.*q_proj"):
        plan(get_model("llama-2-7b"), _config(lora_r=8, lora_targets=("q_prj",)))
    with pytest.raises(PlannerError, match="--lora-targets"):  # peft has no default for DistilBERT
        plan(get_model("distilbert-base-uncased"), _config(lora_r=8))


# ------------------------------------------------------------------------------------------- 4-bit


@pytest.mark.parametrize("shape", [(64, 64), (128, 96), (100, 30), (33, 17), (4096, 4100)])
def test_nf4_storages_match_bitsandbytes(shape):
    """Every storage of quantize_4bit(nf4, double quantization) as bitsandbytes allocates it."""
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(torch.randn(*shape, dtype=torch.bfloat16), blocksize=64,
                                  compress_statistics=True, quant_type="nf4")
    real = {"packed": packed, "absmax": state.absmax, "offset": state.offset, "code": state.code,
            "nested_absmax": state.state2.absmax, "nested_code": state.state2.code}
    real_bytes = {k: t.numel() * t.element_size() for k, t in real.items()}
    assert nf4.weight_storages(shape[0] * shape[1]) == real_bytes


TINY = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
              "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_embd": 48,
             "n_layer": 2, "n_head": 4, "n_positions": 64},
}


def _quantized(module):
    """`module` with every Linear/Conv1D that transformers' bitsandbytes integration converts replaced by a
    real, quantized bnb Linear4bit (nf4, double quantization), then `prepare_model_for_kbit_training`."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import should_convert_module
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = get_keys_to_not_convert(module)
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, torch.nn.Linear | Conv1D) or not should_convert_module(name, skip):
            continue
        weight = sub.weight.data.t() if isinstance(sub, Conv1D) else sub.weight.data
        new = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], sub.bias is not None, torch.bfloat16,
                                compress_statistics=True, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(weight.contiguous(), requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", blocksize=64)
        if sub.bias is not None:
            new.bias = torch.nn.Parameter(sub.bias.data, requires_grad=False)
        new.to("cpu")  # quantizes (Params4bit._quantize)
        module.set_submodule(name, new)
    return peft.prepare_model_for_kbit_training(module, use_gradient_checkpointing=False)


def _device_bytes(model) -> int:
    """Bytes of every parameter storage plus each 4-bit weight's quantization state tensors."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:
            for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code):
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("targets", [("all-linear",), ()])
def test_qlora_counts_and_bytes(family, targets):
    """QLoRA on a real 4-bit model: peft's counts (it counts a Params4bit as its unpacked elements), every
    device byte of the base (4-bit storages + fp32 casts of the rest) and fp32 adapters."""
    cfg = TINY[family]
    spec = hf_config.spec_from_hf_config(cfg, name="tiny")
    with torch.device("cpu"):
        module = getattr(transformers, cfg["architectures"][0])(
            transformers.AutoConfig.for_model(**cfg)).to(torch.bfloat16)
    model = _peft_model(_quantized(module), spec, targets, r=4)
    trainable, everything = model.get_nb_trainable_parameters()
    p = plan(spec, _config(lora_r=4, lora_targets=targets, base_dtype="nf4", precision="amp-bf16"))
    assert (p.trainable, p.frozen) == (trainable, everything - trainable)
    assert sum(b.param_bytes for b in p.blocks.values()) == _device_bytes(model)
    adapters = [t for t in model.parameters() if t.requires_grad]
    assert adapters and all(t.dtype == torch.float32 for t in adapters)
    assert sum(b.grad_bytes for b in p.blocks.values()) == sum(t.numel() * 4 for t in adapters)


@pytest.mark.parametrize("precision,dtype", [("amp-bf16", torch.float32), ("bf16", torch.bfloat16)])
def test_lora_bytes_16bit_base(precision, dtype):
    """A 16-bit or fp32 base: frozen parameters in the base dtype, adapters fp32 (peft autocast_adapter_dtype)."""
    cfg = TINY["llama"]
    spec = hf_config.spec_from_hf_config(cfg, name="tiny")
    module = getattr(transformers, cfg["architectures"][0])(transformers.AutoConfig.for_model(**cfg)).to(dtype)
    model = _peft_model(module, spec, ("q_proj", "v_proj"), r=4)
    p = plan(spec, _config(lora_r=4, lora_targets=("q_proj", "v_proj"), precision=precision))
    assert sum(b.param_bytes for b in p.blocks.values()) == _device_bytes(model)
    assert all(t.dtype == torch.float32 for t in model.parameters() if t.requires_grad)


# ------------------------------------------------------------------------------------------- estimate


def test_estimate_counts_only_the_adapters_states():
    """parameters.trainable/frozen in the Estimate, fp32 gradients and AdamW's two fp32 moments for the
    adapters only, and the base's bytes as the plan stores them."""
    from planner.estimate import estimate

    cfg = TrainConfig(batch_size=2, seq_len=256, precision="amp-bf16", lora_r=16, lora_alpha=32,
                      lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    est = estimate("llama-2-7b", cfg, "ml.g5.2xlarge")
    p = plan(get_model("llama-2-7b"), cfg)
    assert est.parameters["trainable"] == p.trainable and est.parameters["frozen"] == p.frozen
    assert est.parameters["total"] == p.trainable + p.frozen
    assert est.memory_bytes.gradients == 4 * p.trainable
    assert est.memory_bytes.optimizer_states == 8 * p.trainable
    assert est.memory_bytes.parameters == sum(b.param_bytes for b in p.blocks.values())
    qlora = estimate("llama-2-7b", cfg.model_copy(update={"base_dtype": "nf4"}), "ml.g5.2xlarge")
    assert qlora.memory_bytes.parameters < est.memory_bytes.parameters / 3
    assert qlora.memory_bytes.peak_device < est.memory_bytes.peak_device


def test_bad_lora_flags_are_one_line_errors():
    from typer.testing import CliRunner

    from planner.cli.main import app

    runner = CliRunner()
    for args, flag in ((["--lora-r", "0"], "--lora-r"), (["--lora-r", "8", "--lora-targets", "q_prj"], "--lora-targets"),
                       (["--lora-alpha", "16"], "--lora-alpha"), (["--lora-r", "8", "--base-dtype", "nf8"], "--base-dtype"),
                       (["--lora-r", "8", "--precision", "bf16", "--base-dtype", "fp32"], "--base-dtype"),
                       (["--lora-r", "8", "--precision", "bf16", "--base-dtype", "nf4"], "--base-dtype")):
        res = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--instance", "ml.g5.2xlarge", *args])
        assert res.exit_code == 2, args
        assert flag in res.output and "Traceback" not in res.output


def test_sweep_searches_rank_targets_and_base():
    """A sweep's LoRA dimensions become TrainConfig fields of each point; a fixed target list is accepted."""
    from planner.hardware import get_instance
    from planner.search.space import SpaceSpec, resolve_space

    spec = SpaceSpec(lora_ranks=(8, 64), lora_target_sets=("q_proj,v_proj", "all-linear"), base_dtypes=("nf4",),
                     batch_sizes=(2,), seq_lens=(512,), precisions=("amp-bf16",))
    space = resolve_space(spec, get_model("llama-2-7b"), get_instance("ml.g5.2xlarge"))
    assert {"lora_r", "lora_targets"} <= set(space.searched())
    cfg = space.config({"instance": "ml.g5.2xlarge", "lora_r": 64, "lora_targets": "q_proj,v_proj"})
    assert (cfg.lora_r, cfg.lora_targets, cfg.base_dtype) == (64, ("q_proj", "v_proj"), "nf4")
    fixed = resolve_space(SpaceSpec(batch_sizes=(2,)), get_model("llama-2-7b"), get_instance("ml.g5.2xlarge"),
                          fixed={"lora_r": 16, "lora_targets": ["all-linear"]})
    one = fixed.config({"instance": "ml.g5.2xlarge", "seq_len": 512, "precision": "amp-bf16",
                        "checkpointing": False, "optimizer_impl": "foreach", "attention": "sdpa"})
    assert (one.lora_r, one.lora_targets) == (16, ("all-linear",))

"""LoRA on traced models (`planner.adapters.traced`): a config.json outside the six families with peft's
adapters on it, traced under fake tensors, against the real module with the same adapters: trainable and
frozen counts as peft counts them, and the bytes saved for backward (CPU kernels) as saved-tensor hooks see."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from planner.adapters.traced import with_adapters  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.program.trace import trace_step  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402
from tests.test_trace import _tiny_configs, real_saved_bytes  # noqa: E402


@pytest.mark.parametrize("arch,targets", [("Qwen2ForCausalLM", ("q_proj", "v_proj")),
                                          ("T5ForConditionalGeneration", ("all-linear",)),
                                          ("BartForConditionalGeneration", ("q_proj", "v_proj", "fc1"))])
def test_traced_adapters_match_real_peft(arch, targets):
    from planner.program import hf

    config = hf.hf_config_object(_tiny_configs()[arch], "config.json", "eager")
    make = hf.batch_maker(config, "config.json")
    cfg = TrainConfig(batch_size=2, seq_len=6, lora_r=4, lora_targets=targets)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = with_adapters(lambda: hf.model_class(config)(config), cfg)().train()
        counted = peft.get_peft_model(hf.model_class(config)(config), peft.LoraConfig(
            r=4, target_modules="all-linear" if targets == ("all-linear",) else list(targets)))
    trainable, everything = counted.get_nb_trainable_parameters()
    expected = real_saved_bytes(real, make(2, 6), lambda m, b: m(**b).loss)
    trace = trace_step(with_adapters(hf.builder(config, "config.json"), cfg), make, cfg, backend="cpu")
    assert (trace.parameters["trainable"], trace.parameters["frozen"]) == (trainable, everything - trainable)
    assert trace.saved_bytes == expected
    assert sum(trace.block_trainable.values()) == trainable


def test_traced_models_refuse_a_4bit_base():
    cfg = TrainConfig(batch_size=2, seq_len=6, lora_r=4, lora_targets=("q_proj",), base_dtype="nf4")
    with pytest.raises(PlannerError, match="--base-dtype"):
        with_adapters(lambda: None, cfg)

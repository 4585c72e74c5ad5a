"""What peft's preparation does to a model, checked on a tiny Llama on the CPU against the rules the planner
reads (`planner.adapters.activations.input_requires_grad`, `planner.adapters.lora` frozen dtypes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from planner.adapters.activations import input_requires_grad  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("ckpt", [False, True])
def test_embedding_output_requires_grad_only_with_checkpointing(quantized, ckpt):
    """QLoRA: prepare_model_for_kbit_training (is_loaded_in_4bit set, as transformers' 4-bit load sets it;
    the rule reads only the flag) then get_peft_model; LoRA: get_peft_model, with transformers' checkpointing
    turned on first when asked."""
    model = _tiny_llama()
    if quantized:
        model.is_loaded_in_4bit = True
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt)
    elif ckpt:
        model.gradient_checkpointing_enable()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.05, task_type="CAUSAL_LM"))
    seen = {}

    def hook(module, args, output):
        seen["requires_grad"] = output.requires_grad

    model.get_input_embeddings().register_forward_hook(hook)
    model.train()
    model(input_ids=torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)))
    cfg = TrainConfig(batch_size=1, seq_len=8, precision="amp-bf16", lora_r=4, checkpointing=ckpt,
                      base_dtype="nf4" if quantized else "bf16")
    assert seen["requires_grad"] == input_requires_grad(cfg)
    if quantized:  # prepare_model_for_kbit_training: every 16-bit parameter that is not 4-bit becomes fp32
        base = model.get_base_model()
        assert base.get_input_embeddings().weight.dtype == torch.float32
        assert base.model.norm.weight.dtype == torch.float32 and base.lm_head.weight.dtype == torch.float32


def test_four_bit_mlp_tensors_are_saved_in_fp32_under_amp():
    """bitsandbytes' Linear4bit returns its input's dtype: with prepare_model_for_kbit_training's fp32 norms
    and embeddings, the gated MLP's gate, up and SiLU outputs are saved in fp32 under autocast (3 per layer);
    the planner's records say the same of exactly those tensors (`four_bit_outputs`)."""
    bnb = pytest.importorskip("bitsandbytes")
    import collections
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    model = _tiny_llama()
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                        compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                        device="meta")
                new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                               quant_type="nf4", blocksize=64).to("cpu")
                setattr(parent, name, new)
    model.is_loaded_in_4bit = True
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.05, task_type="CAUSAL_LM"))
    model.train()
    b, s, inter = 2, 8, model.config.intermediate_size
    seen: collections.Counter = collections.Counter()

    def pack(t):
        seen[(t.dtype, tuple(t.shape))] += 1
        return t

    ids = torch.randint(0, 64, (b, s))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    layers = model.config.num_hidden_layers
    assert seen[(torch.float32, (b, s, inter))] == 3 * layers
    assert seen[(torch.bfloat16, (b, s, inter))] == 0

    estimate_mod = importlib.import_module("planner.estimate")
    kw = dict(batch_size=1, seq_len=128, precision="amp-bf16", lora_r=16, lora_targets=("q_proj", "v_proj"))
    for base, dtype in (("nf4", "float32"), ("fp32", "bfloat16")):
        prep = estimate_mod._prepare("llama-2-7b", TrainConfig(**kw, base_dtype=base), "ml.p5e.48xlarge", None,
                                     "cuda", None)
        mlp = {t.name: t.dtype for t in prep.activations[3].tensors if t.name.startswith("mlp.")}
        assert mlp == dict.fromkeys(("mlp.act.input", "mlp.act_output", "mlp.up"), dtype)

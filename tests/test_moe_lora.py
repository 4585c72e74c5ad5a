"""LoRA and QLoRA on mixture-of-experts models (issue 35 item 5), against peft 0.21 on tiny transformers 5 models.

- trainable and frozen counts equal peft's `get_nb_trainable_parameters` with adapters on attention (and a shared
  expert's / dense layer's Linears) only, and with the fused experts too (`--lora-targets ... experts`: peft's
  `target_parameters`, ParamWrapper: lora_A (r·E, in), lora_B (out, r·E) per expert weight);
- the LoRA program's parameter tensors are peft's, names and shapes (nested ParamWrapper names included);
- what a step saves, per block, equals autograd's saved-tensor hooks on the real peft module on CPU (frozen
  router and experts keep no inputs; adapted experts keep the merged weight stack W'), for Mixtral, Qwen2-MoE
  (shared expert and dense layer), OLMoE and Qwen3-MoE in fp32, amp-bf16 and bf16; the first adapted layer of
  a q/k-normed model is over by its k_norm's tensors, asserted as such;
- QLoRA: the experts are not nn.Linear, so bitsandbytes leaves them and prepare_model_for_kbit_training casts
  them to fp32: every device byte equals the real quantized model's;
- expert parallelism splits the frozen experts and their adapters; the CLI takes it; bad input is one line.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
from typer.testing import CliRunner

from planner.adapters.lora import plan
from planner.models import hf_config
from planner.spec import TrainConfig
from tests.test_moe import TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Attention targets per family (MLA has no q_proj / v_proj in DeepSeek with a query bottleneck).
ATTENTION = {"mixtral": ("q_proj", "v_proj"), "qwen3_moe": ("q_proj", "v_proj"), "olmoe": ("q_proj", "k_proj"),
             "qwen2_moe": ("q_proj", "v_proj", "gate_proj", "up_proj"), "gpt_oss": ("q_proj", "v_proj"),
             "deepseek_v3": ("q_b_proj", "kv_b_proj")}


def _real(case: str, dtype=None):
    cfg = {k: v for k, v in TINY[case].items()}
    model_type = cfg.pop("model_type")
    conf = transformers.AutoConfig.for_model(model_type, **cfg)
    module = getattr(transformers, cfg["architectures"][0])(conf)
    return module.to(dtype) if dtype is not None else module


def _inject(module, modules: tuple[str, ...], experts: bool):
    """peft's LoRA injected in place, adapters fp32 (autocast_adapter_dtype), as tests/saved_tensors.inject_lora
    does, with the fused experts as target_parameters when asked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = peft.inject_adapter_in_model(peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=list(modules) or None,
            target_parameters=EXPERT_PARAMS if experts else None), module)
    for name, p in module.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return module


def _config(case: str, experts: bool, **kw: Any) -> TrainConfig:
    return TrainConfig(**({"batch_size": 2, "seq_len": 24, "lora_r": 4, "lora_alpha": 8,
                           "lora_targets": ATTENTION[case] + (("experts",) if experts else ())} | kw))


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
@pytest.mark.parametrize("case", list(ATTENTION))
def test_counts_match_peft(case, experts):
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_real(case), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=list(ATTENTION[case]),
            target_parameters=EXPERT_PARAMS if experts else None))
    trainable, everything = model.get_nb_trainable_parameters()
    p = plan(spec, _config(case, experts))
    assert (p.trainable, p.frozen) == (trainable, everything - trainable)
    assert p.adapted_experts == (2 * sum(spec.transformers[0].sparse_layer(i)
                                         for i in range(spec.transformers[0].num_layers)) if experts else 0)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "qwen2_moe"])
def test_program_parameters_are_peft_s(case):
    """Names and shapes, the nested ParamWrapper names of both adapted expert weights included."""
    from planner.adapters.activations import lora_program
    from planner.ir.context import Ctx

    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    cfg = _config(case, True)
    program = lora_program(spec, cfg, plan(spec, cfg), Ctx(2, 24, "fp32", "sdpa", "cpu", True))
    with torch.device("meta"):
        module = _inject(_real(case), ATTENTION[case], True)
    real = sorted((n, tuple(p.shape)) for n, p in module.named_parameters())
    assert sorted((p.name, p.shape) for p in program.params) == real


def _saved(case: str, precision: str, experts: bool) -> tuple[dict[str, int], dict[str, int]]:
    from planner.adapters.activations import lora_activations
    from planner.memory.activations import activation_blocks
    from tests import saved_tensors as st

    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    cfg = _config(case, experts, precision=precision, attention="sdpa")
    torch.manual_seed(0)
    measured = st.measure(spec, cfg, fake=False, keep_tensors=False,
                          transform=lambda m: _inject(m, ATTENTION[case], experts)).per_block
    records = activation_blocks(spec, cfg, backend="cpu")
    predicted = lora_activations(spec, cfg, tuple(records), plan(spec, cfg), backend="cpu")
    return dict(measured), {r.block: r.saved_bytes + r.weight_cast_bytes for r in predicted}


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_saved_bytes_match_real_peft(case, precision, experts):
    """Every block equal to the hooks: the frozen router keeps softmax, top-k and weighting tensors but not
    its input; frozen experts keep no GEMM input; adapted experts keep their GEMM inputs and the merged stack
    W' (E × in × out in the experts' dtype; in pure 16-bit also the adapters' 16-bit factor copies)."""
    measured, predicted = _saved(case, precision, experts)
    assert {b: v for b, v in predicted.items() if v} == {b: v for b, v in measured.items() if v}


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
def test_saved_bytes_qwen3_first_adapted_layer_over_by_its_k_norm(experts):
    """Qwen3-MoE normalises k per head; in the first adapted layer k's projection has no adapter and its input
    no gradient, so k_norm keeps nothing there, which the transform does not see: that layer is over by
    k_norm's input and rstd (b·s·kv·d + b·s·kv fp32), every other block exact."""
    measured, predicted = _saved("qwen3_moe", "amp-bf16", experts)
    t = TINY["qwen3_moe"]
    over = 2 * 24 * t["num_key_value_heads"] * (t["head_dim"] + 1) * 4
    assert predicted["model.layer.0"] - measured["model.layer.0"] == over
    rest = {b: v for b, v in predicted.items() if v and b != "model.layer.0"}
    assert rest == {b: v for b, v in measured.items() if v and b != "model.layer.0"}


def test_adapted_experts_keep_the_merged_stack():
    """The point: LoRA on the fused experts keeps, per sparse layer, a merged copy of the expert stack for
    backward (peft 0.21 _LoraFactorsProxy's baddbmm output, which grouped_mm saves): far more than the
    attention-only run, and that difference is W' exactly."""
    measured_att, _ = _saved("mixtral", "fp32", False)
    measured_exp, _ = _saved("mixtral", "fp32", True)
    t = TINY["mixtral"]
    h, i, e = t["hidden_size"], t["intermediate_size"], t["num_local_experts"]
    pairs = 2 * 24 * t["num_experts_per_tok"]
    merged = e * (h * 2 * i + i * h) * 4
    inputs = pairs * (h + i) * 4  # the grouped GEMMs' inputs, which a frozen expert does not keep
    for layer in ("model.layer.0", "model.layer.1"):
        assert measured_exp[layer] - measured_att[layer] == merged + inputs


def _quantized(module):
    """tests/test_lora.py's real bitsandbytes 4-bit base, then prepare_model_for_kbit_training."""
    from tests.test_lora import _quantized as quantize

    return quantize(module)


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
def test_qlora_keeps_the_experts_fp32(experts):
    """bitsandbytes replaces nn.Linear only; the fused experts stay 16-bit and prepare_model_for_kbit_training
    casts them (with norms, embeddings, the router) to fp32: every device byte equals the real model's."""
    pytest.importorskip("bitsandbytes")
    from tests.test_lora import _device_bytes

    case = "qwen3_moe"
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    module = _quantized(_real(case, torch.bfloat16))
    experts_dtype = {p.dtype for n, p in module.named_parameters() if "experts" in n}
    assert experts_dtype == {torch.float32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTENTION[case]),
                                                            target_parameters=EXPERT_PARAMS if experts else None))
    trainable, everything = model.get_nb_trainable_parameters()
    p = plan(spec, _config(case, experts, base_dtype="nf4", precision="amp-bf16"))
    assert (p.trainable, p.frozen) == (trainable, everything - trainable)
    assert sum(b.param_bytes for b in p.blocks.values()) == _device_bytes(model)


# ------------------------------------------------------------------------------------ estimate and CLI

runner = CliRunner()


def _estimate(*args: str):
    from planner.cli.main import app

    return runner.invoke(app, ["estimate", "--model", "qwen3-30b-a3b", "--instance", "ml.p5.48xlarge",
                               "--instances", "2", "--batch-size", "1", "--seq-len", "1024", "--precision",
                               "amp-bf16", "--lora-r", "16", "--json", *args])


def test_expert_parallelism_splits_frozen_experts_and_their_adapters():
    """Under DDP each rank holds all dense parameters and 1/ep of every layer's experts, frozen weights (fp32
    under AMP) and adapters (fp32) alike."""
    from planner.models.blocks import model_blocks
    from planner.models.catalog import get_model
    from planner.models.params import expert_parameters

    spec = get_model("qwen3-30b-a3b")
    experts = sum(expert_parameters(b) for b in model_blocks(spec))
    by_ep = {}
    for ep in (1, 16):
        res = _estimate("--parallelism", "ddp", "--ep", str(ep), "--lora-targets", "q_proj,v_proj,experts")
        assert res.exit_code == 0, res.output
        by_ep[ep] = json.loads(res.output)
    p = plan(spec, TrainConfig(batch_size=1, seq_len=8, lora_r=16, lora_targets=("q_proj", "v_proj", "experts")))
    expert_adapters = sum(sum(s[0] * s[1] for s in b.expert_shapes) for b in p.blocks.values())
    saved = (experts + expert_adapters) * 4 * 15 // 16
    assert by_ep[1]["memory_bytes"]["parameters"] - by_ep[16]["memory_bytes"]["parameters"] == saved
    assert by_ep[16]["parameters"]["trainable"] == p.trainable
    assert by_ep[16]["parameters"]["active"] == by_ep[1]["parameters"]["active"] < p.frozen  # the base's


def test_cli_takes_experts_and_reports_the_split():
    res = _estimate("--parallelism", "fsdp", "--ep", "16", "--checkpointing", "--lora-targets",
                    "q_proj,v_proj,experts")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert 0 < d["parameters"]["trainable"] < d["parameters"]["total"]
    assert d["verdict"] in ("fits", "tight", "oom") and d["throughput"]["tokens_per_s"] > 0
    attention_only = json.loads(_estimate("--parallelism", "fsdp", "--ep", "16", "--checkpointing",
                                          "--lora-targets", "q_proj,v_proj").output)
    assert d["throughput"]["step_time_s"] > attention_only["throughput"]["step_time_s"]  # the merges and dW'


@pytest.mark.parametrize("args,needle", [
    (("--model", "llama-3-8b", "--lora-targets", "q_proj,experts"), "has no fused experts"),
    (("--lora-targets", "q_proj,experts", "--lora-dropout", "0.1"), "--lora-dropout"),
    (("--lora-targets", "experts_typo"), "or experts for the fused experts"),
    (("--lora-targets", "q_proj,gate_proj,up_proj"), "peft 0.21 turns gate, gate_proj, up_proj, down_proj"),
    (("--lora-targets", "all-linear"), "--lora-targets"),
])
def test_bad_expert_targets_are_one_line_exit_2(args, needle):
    from planner.cli.main import app

    base = ["estimate", "--instance", "ml.p5.48xlarge", "--batch-size", "1", "--seq-len", "128", "--lora-r", "8"]
    if "--model" not in args:
        base += ["--model", "qwen3-30b-a3b"]
    res = runner.invoke(app, [*base, *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize("extra", [{}, {"base_dtype": "nf4"}], ids=["lora", "qlora"])
def test_estimate_program_sums_to_the_memory_terms(extra):
    """`estimate --json`'s program under LoRA on the experts sums to the memory terms on one GPU, as for dense
    models (tests/test_lora_program.py): parameters (frozen experts in the base's storage, their adapters fp32)
    and saved bytes (the merged stacks included)."""
    from planner.estimate import estimate, program

    cfg = TrainConfig(batch_size=1, seq_len=256, precision="amp-bf16", parallelism="single", lora_r=8,
                      lora_targets=("q_proj", "v_proj", "experts"), **extra)
    est = estimate("qwen3-30b-a3b", cfg, "ml.p5.48xlarge", with_throughput=False)
    ops = [op for b in program("qwen3-30b-a3b", est)["blocks"] for op in b["ops"]]
    assert sum(op["param_bytes"] for op in ops) == est.memory_bytes.parameters
    assert sum(op["saved_bytes"] for op in ops) == est.memory_bytes.activations


def test_probe_job_passes_experts_as_target_parameters():
    """jobs/probe.py turns the planner's `experts` into peft's target_parameters (and leaves module names)."""
    from jobs.probe import _split_lora_targets

    assert _split_lora_targets(("q_proj", "v_proj", "experts")) == (
        ["q_proj", "v_proj"], ["experts.gate_up_proj", "experts.down_proj"])
    assert _split_lora_targets(("all-linear", "mlp.experts.down_proj")) == (["all-linear"], ["mlp.experts.down_proj"])


def _baddbmm_calls(module, cfg: TrainConfig) -> int:
    """aten.baddbmm calls in one real training step (forward, recompute, backward): peft 0.21 merges each
    adapted expert weight with a baddbmm (_LoraFactorsProxy) twice per forward (registering the
    parametrization computes it once to check it), and backward runs none (its gradients are autograd's
    bmm's and mm's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.baddbmm.default:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    module.train()
    ids = torch.randint(3, 100, (cfg.batch_size, cfg.seq_len))
    with Count():
        module(input_ids=ids).logits.float().sum().backward()
    return len(calls)


def test_checkpointing_recomputes_the_expert_merges():
    """Under non-reentrant activation checkpointing the recomputed forward merges each adapted expert stack
    again (issue 35: `program_kernels` had skipped them): the LoRA kernel list's merges, forward and
    recompute, equal the baddbmm calls of the real checkpointed peft model, and a step without checkpointing
    runs half as many."""
    from planner.perf.micro_step import micro_kernels

    spec = hf_config.spec_from_hf_config(TINY["mixtral"], name="mixtral")
    counts = {}
    for ckpt in (False, True):
        cfg = _config("mixtral", True, checkpointing=ckpt, attention="sdpa")
        torch.manual_seed(0)
        module = _real("mixtral")
        if ckpt:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            module.enable_input_require_grads()
        real = _baddbmm_calls(_inject(module, ATTENTION["mixtral"], True), cfg)
        merges = {ph: sum(k.count for k in micro_kernels(spec, cfg) if ".lora_merge" in k.name
                          and k.phase == ph) for ph in ("forward", "recompute")}
        assert merges["forward"] + merges["recompute"] == real
        counts[ckpt] = merges
    assert counts[False]["recompute"] == 0 < counts[True]["recompute"] == counts[True]["forward"]

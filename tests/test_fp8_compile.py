"""Issue 35, FP8 and torch.compile: the compile rules against AOTAutograd's min-cut partitioner on a real
Llama layer (CPU, no codegen), the FP8 rules against their sources, the estimate's contract and bad input."""

from __future__ import annotations

import json

import pytest

from planner.ir import fp8
from planner.ir.context import Ctx
from planner.ir.transforms import FUSIBLE_KINDS, compile_ops, fp8_ops
from planner.memory import activations as act
from tests.test_bad_input import assert_one_line_error, invoke

H, INTER, HEADS, KV, B, S = 64, 176, 4, 2, 2, 16


def _min_cut_saved(amp: bool) -> int:
    """Bytes of the storages the forward of one LlamaDecoderLayer saves for backward under torch.compile's
    partitioner (functorch.compile.aot_function with min_cut_rematerialization_partition, a no-op compiler):
    the forward graph's outputs after the layer's output, less the parameters and the rotary tables (shared
    by every layer); the layer's input counts (the partitioner saves it)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV,
                      num_hidden_layers=1, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    dt = torch.float32 if amp else torch.bfloat16
    layer = LlamaDecoderLayer(cfg, 0).to(dt)
    x = torch.randn(B, S, H, dtype=dt, requires_grad=True)
    pos = torch.arange(S)[None].expand(B, S)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    params = dict(layer.named_parameters())

    def f(x, cos, sin, *ps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = torch.func.functional_call(layer, dict(zip(params, ps, strict=True)), (x,),
                                             {"position_embeddings": (cos, sin), "attention_mask": None})
        return out[0] if isinstance(out, tuple) else out

    return _aot_saved_bytes(f, (x, cos, sin, *params.values()), (cos, sin, *params.values()))


def _aot_saved_bytes(f, inputs, skip) -> int:
    """Bytes of the storages the forward graph of `f` saves for backward under the min-cut partitioner (no-op
    compilers), less those of `skip`."""
    import torch
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    record: dict[str, tuple] = {}

    def fw(gm, _):
        def run(*a):
            record["out"] = gm(*a)
            return record["out"]
        return run

    aot_function(f, fw_compiler=fw, bw_compiler=lambda gm, _: gm,
                 partition_fn=min_cut_rematerialization_partition)(*inputs)
    known = {t.untyped_storage().data_ptr() for t in skip}
    total = 0
    for t in record["out"][1:]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
            known.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_compile_rules_on_a_post_norm_layer_equal_the_min_cut_partitioner():
    """A BERT layer (LayerNorm, GELU, no dropout) in bf16: the partitioner saves as many bytes as eager (it
    trades the GELU output for the up-projection's output), which the planner's rules give too."""
    pytest.importorskip("transformers")
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from tests.saved_tensors import model

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=H, intermediate_size=4 * H, num_attention_heads=HEADS, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "sdpa"
    layer = BertLayer(cfg).to(torch.bfloat16).train()
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    params = dict(layer.named_parameters())

    def f(x, *ps):
        out = torch.func.functional_call(layer, dict(zip(params, ps, strict=True)), (x,))
        return out[0] if isinstance(out, tuple) else out

    measured = _aot_saved_bytes(f, (x, *params.values()), params.values())
    spec = model("bert", layers=1, hidden=H, heads=HEADS, intermediate=4 * H, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
    ctx = Ctx(B, S, "bf16", "sdpa", "cpu", False, compile=True)
    assert sum(t.nbytes for t in act.layer_saved(spec.transformers[0], ctx, 1)) == measured


def _planner_saved(precision: str, compiled: bool) -> int:
    from tests.saved_tensors import model

    spec = model("llama", layers=1, hidden=H, heads=HEADS, intermediate=INTER, kv_heads=KV)
    ctx = Ctx(B, S, precision, "sdpa", "cpu", False, compile=compiled)
    from planner.models.blocks import model_blocks

    layer = next(b for b in model_blocks(spec) if b.role == "layer")
    # index 1: the rotary tables are counted on a model's first layer only (shared), as the measurement skips
    # them; autocast's 16-bit weight casts are saved by the graph too (a separate term of the memory model)
    return sum(t.nbytes for t in act.layer_saved(spec.transformers[0], ctx, 1) + act.weight_casts(layer, ctx))


@pytest.mark.parametrize(("precision", "amp"), [("bf16", False), ("amp-bf16", True)])
def test_compile_rules_equal_the_min_cut_partitioner(precision, amp):
    """The per-op-kind compile rules (planner.ir.transforms) give the bytes torch's min-cut partitioner saves
    for a real Llama layer, and fewer than eager."""
    pytest.importorskip("transformers")
    measured = _min_cut_saved(amp)
    assert _planner_saved(precision, True) == measured
    assert _planner_saved(precision, False) > measured


def test_compile_marks_only_pointwise_ops():
    from planner.families.forms import block_ops, load_forms
    from planner.models.blocks import model_blocks
    from tests.saved_tensors import model

    load_forms()
    spec = model("llama", layers=1, hidden=H, heads=HEADS, intermediate=INTER, kv_heads=KV)
    ctx = Ctx(B, S, "amp-bf16", "sdpa", "cuda", False)
    layer = next(b for b in model_blocks(spec) if b.role == "layer")
    ops = block_ops(layer, spec, ctx)
    marked = compile_ops(ops)
    assert {op.kind for op in marked if op.attrs.get("fused")} == {op.kind for op in ops} & FUSIBLE_KINDS
    assert not any(op.attrs.get("fused") for op in marked if op.kind in ("linear", "attention_flash"))
    assert all(op.attrs.get("fp8") == "tensorwise" for op in fp8_ops(ops, "tensorwise") if op.kind == "linear")


def test_fp8_rules_follow_their_sources():
    # torchao saves the high-precision input and weight (matmul_with_hp_or_float8_args.forward)
    assert fp8.input_saved("tensorwise") is None and fp8.weight_copies("rowwise") == 0
    # Transformer Engine: FP8 input, the FP8 weight and its transpose; MXFP8 adds one scale per 32
    assert fp8.input_saved("delayed") == (fp8.F8, 1) and fp8.weight_copies("current") == 2
    assert fp8.weight_copies("mxfp8") == 2 * (1 + 1 / 32)
    # DelayedScaling.amax_history_len = 1024 fp32, five scaled tensors per Linear
    assert fp8.amax_history_bytes("delayed", 1) == 5 * 1024 * 4 and fp8.amax_history_bytes("tensorwise", 9) == 0
    assert fp8.default_recipe("torchtitan") == "tensorwise" and fp8.default_recipe("megatron") == "delayed"


def _estimate(*extra: str) -> dict:
    code, out, err = invoke(["estimate", "--model", "llama-3-8b", "--instance", "ml.p5.48xlarge", "--parallelism",
                             "fsdp", "--json", *extra])
    assert code == 0, err
    return json.loads(out)


def test_the_done_when_command_and_what_fp8_and_compile_change():
    """`estimate --precision fp8 --fp8-recipe tensorwise --compile --json`: memory per rank, verdict, tokens/s,
    MFU; FP8 makes the layers' GEMMs faster than amp-bf16 on an H100 and drops autocast's 16-bit weight copies
    (torchao casts fp32 weights to FP8 itself); compile saves less; TE's delayed recipe saves FP8 weight
    copies."""
    base = _estimate("--precision", "amp-bf16")
    got = _estimate("--precision", "fp8", "--fp8-recipe", "tensorwise", "--compile")
    assert got["config"]["precision"] == "fp8" and got["config"]["fp8_recipe"] == "tensorwise"
    assert got["config"]["compile"] is True
    assert got["verdict"] in ("fits", "tight", "oom") and got["memory_bytes"]["peak_device"] > 0
    assert got["throughput"]["tokens_per_s"] > base["throughput"]["tokens_per_s"]
    assert 0 < got["throughput"]["mfu"] < 1
    for key in ("tokens_per_s_per_gpu", "mfu"):  # per GPU is another engineer's field: checked where present
        if key in got["throughput"]:
            assert got["throughput"][key] > 0
    fp8_only = _estimate("--precision", "fp8")
    compiled = _estimate("--precision", "amp-bf16", "--compile")
    delayed = _estimate("--precision", "fp8", "--fp8-recipe", "delayed")
    act_ = {k: v["memory_bytes"]["activations"] for k, v in
            {"base": base, "fp8": fp8_only, "compile": compiled, "delayed": delayed, "both": got}.items()}
    assert act_["fp8"] < act_["base"] and act_["compile"] < act_["base"] and act_["both"] < act_["fp8"]
    assert act_["delayed"] > act_["fp8"]
    assert fp8_only["config"]["fp8_recipe"] == "tensorwise"  # the default (torchao / torchtitan)


@pytest.mark.parametrize(("args", "names"), [
    (["--instance", "ml.p3.2xlarge", "--precision", "fp8"], ("--precision", "fp8", "ml.p5")),
    (["--instance", "ml.g5.2xlarge", "--precision", "fp8"], ("--precision", "A10G", "sm89")),
    (["--instance", "ml.p4d.24xlarge", "--precision", "fp8"], ("--precision", "A100")),
    (["--instance", "ml.p5.48xlarge", "--precision", "fp8", "--fp8-recipe", "mxfp8"], ("--fp8-recipe", "mxfp8")),
    (["--instance", "ml.p5.48xlarge", "--precision", "fp8", "--fp8-recipe", "bogus"], ("fp8",)),
    (["--instance", "ml.g5.2xlarge", "--compile", "--torch-version", "1.13"], ("--compile", "1.13", "2.0")),
    (["--instance", "ml.p5.48xlarge", "--fp8-recipe", "rowwise"], ("--fp8-recipe", "--precision fp8")),
    (["--instance", "ml.p5.48xlarge", "--precision", "fp8", "--fp8-recipe", "delayed", "--parallelism", "fsdp",
      "--fp8-param-gather"], ("--fp8-param-gather", "torchao")),
    (["--instance", "ml.p5.48xlarge", "--precision", "fp8", "--parallelism", "ddp", "--fp8-param-gather"],
     ("--fp8-param-gather", "fsdp")),
])
def test_bad_input_is_one_line(args, names, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = invoke(["estimate", "--model", "llama-3-8b", "--batch-size", "1", *args])
    assert_one_line_error(code, err, *names)
    assert list(tmp_path.iterdir()) == []


def test_fp8_gemms_are_the_layers_and_compile_fuses_launches():
    """Under FP8 the layers' Linear GEMMs (forward, dgrad, wgrad) are FP8, the LM head's stay bf16, each FP8
    Linear adds casting kernels, and the FP8 peak is the one the roofline reads; compile leaves the GEMMs and
    launches fewer kernels."""
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.perf import kernels as K
    from planner.perf.roofline import peak_key
    from planner.spec import TrainConfig

    spec = cached_model("llama-3-8b")
    cfg = TrainConfig(batch_size=1, seq_len=256, precision="amp-bf16", attention="sdpa", parallelism="fsdp")

    def kernels(**ctx_kw):
        ctx = Ctx(1, 256, "amp-bf16", "sdpa", "cuda", False, **ctx_kw)
        return K.training_kernels(spec, cfg, ctx=ctx)

    base, f8, comp = kernels(), kernels(fp8="tensorwise"), kernels(compile=True)
    layer_gemms = [k for k in f8 if k.gemm is not None and k.kind == "gemm" and k.block_role == "layer"]
    assert layer_gemms and all(k.dtype == fp8.F8 for k in layer_gemms)
    assert all(k.dtype == "bfloat16" for k in f8 if k.gemm is not None and k.block_role == "head")
    assert any(".fp8_cast" in k.name for k in f8) and not any(".fp8_cast" in k.name for k in base)
    assert peak_key(get_instance("ml.p5.48xlarge").gpu, fp8.F8, False) == "fp8"
    gemm_flops = sorted(k.flops * k.count for k in comp if k.gemm is not None)
    assert gemm_flops == sorted(k.flops * k.count for k in base if k.gemm is not None)
    launches = {n: sum(k.launches * k.count for k in ks) for n, ks in (("base", base), ("compile", comp))}
    assert launches["compile"] < launches["base"]

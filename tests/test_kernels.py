"""The kernel list of one training step (planner.perf.kernels) against real PyTorch.

- its GEMM + attention FLOPs equal planner.perf.flops (itself checked against FlopCounterMode);
- bytes of single ops equal the nbytes of the tensors a real module's ATen op reads and writes;
- the whole step of small catalog models (BERT, GPT-2, Llama) against the ATen ops a TorchDispatchMode sees
  in one training step (forward, loss, backward, foreach AdamW) on CPU under FakeTensorMode: every op is
  either modelled by kernels of the list (counts checked for matmuls, norms, softmax, activations, embedding
  backward, loss, optimizer) or named free (views, metadata, CPU-side scalars).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from planner.perf import flops  # noqa: E402
from planner.perf.kernels import optimizer_kernels  # noqa: E402
from planner.perf.micro_step import micro_kernels  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402
from tests.saved_tensors import make_batch, model, multimodal  # noqa: E402

SPECS = {
    "bert-cls": lambda: model("bert", "sequence-classification"),
    "bert-mlm": lambda: model("bert", "masked-lm"),
    "roberta-cls": lambda: model("roberta", "sequence-classification"),
    "distilbert-cls": lambda: model("distilbert", "sequence-classification"),
    "gpt2-lm": lambda: model("gpt2", "causal-lm"),
    "gpt2-cls": lambda: model("gpt2", "sequence-classification"),
    "llama-lm": lambda: model("llama", "causal-lm", kv_heads=2),
    "multimodal": lambda: multimodal("bert"),
}


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_matmul_flops_equal_flops_py(name, precision, attention, checkpointing):
    spec = SPECS[name]()
    cfg = TrainConfig(batch_size=3, seq_len=40, precision=precision, attention=attention,
                      checkpointing=checkpointing)
    ks = micro_kernels(spec, cfg)
    ours = sum(k.flops * k.count for k in ks if k.kind in ("gemm", "attention"))
    assert ours == flops.step_flops(spec, cfg).executed
    assert all(k.bytes_read >= 0 and k.bytes_written >= 0 and k.count >= 1 for k in ks)


# ---- bytes of single ops vs the tensors ---------------------------------------------------------------


class OpBytes(TorchDispatchMode):
    """Per ATen op: bytes of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        flat_out = torch.utils._pytree.tree_leaves(out)
        read = sum(t.nbytes for t in flat_in if isinstance(t, torch.Tensor))
        written = sum(t.nbytes for t in flat_out if isinstance(t, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, read, written))
        return out


def test_bytes_match_the_tensors_of_a_bert_layer():
    """fp32 BERT layer forward and backward on CPU: the Q projection (addmm), the first LayerNorm, GELU, the
    scores bmm and their backward ops read and write exactly what their tensors hold (LayerNorm's CPU
    statistics are fp32 here, like CUDA's)."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    spec = model("bert", "sequence-classification", hidden_size=64)
    t = spec.transformers[0]
    b, s = 2, 24
    layer = BertLayer(BertConfig(hidden_size=t.hidden_size, num_attention_heads=t.num_heads,
                                 intermediate_size=t.intermediate_size, attn_implementation="eager")).train()
    rec = OpBytes()
    x = torch.randn(b, s, t.hidden_size, requires_grad=True)
    with rec:
        layer(x)[0].sum().backward()
    seen = collections.defaultdict(list)
    for op, r, w in rec.ops:
        seen[op].append((r, w))
    ks = {k.name: k for k in micro_kernels(spec, TrainConfig(batch_size=b, seq_len=s, attention="eager"))}
    q = ks["layer.attention.self.query"]
    assert (q.bytes_read, q.bytes_written) == seen["addmm"][0]
    ln = ks["layer.attention.output.LayerNorm"]
    assert (ln.bytes_read, ln.bytes_written) == seen["native_layer_norm"][0]
    gelu = ks["layer.mlp.act"]
    assert (gelu.bytes_read, gelu.bytes_written) == seen["gelu"][0]
    scores = ks["layer.attention.scores"]
    assert (scores.bytes_read, scores.bytes_written) == seen["bmm"][0]
    # backward: GELU's and LayerNorm's input gradients read what their tensors hold (the output LayerNorm
    # runs backward first), and the down projection's dX = dY·Wᵀ is the first mm of backward
    bwd = {k.name: k for k in micro_kernels(spec, TrainConfig(batch_size=b, seq_len=s, attention="eager"))}
    gelu_b = bwd["layer.mlp.act.backward"]
    assert (gelu_b.bytes_read, gelu_b.bytes_written) == seen["gelu_backward"][0]
    ln_b = bwd["layer.output.LayerNorm.backward"]
    assert (ln_b.bytes_read, ln_b.bytes_written) == seen["native_layer_norm_backward"][0]
    dx = bwd["layer.output.dense.grad_input"]
    assert (dx.bytes_read, dx.bytes_written) == seen["mm"][0]


# ---- the whole step vs the ATen ops ---------------------------------------------------------------------

# ATen ops that launch no GPU kernel: views and metadata, autograd bookkeeping, allocation without
# initialisation, host-side scalars (the optimizer's step counters live on the CPU when capturable=False),
# the optimizer's state initialisation (first step only).
FREE = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select",
    "split", "split_with_sizes", "permute", "alias", "detach", "lift_fresh", "as_strided", "device", "empty_like",
    "_record_function_enter_new", "_record_function_exit", "_local_scalar_dense", "zeros_like", "empty",
    "ones_like",  # loss.backward()'s seed gradient (one element)
}
# CPU kernels that stand for one CUDA kernel of our list: CPU dropout is bernoulli_ + div_ + mul where CUDA
# runs native_dropout; matmul's contiguous copies are clones; mask building (arange, le, bitwise_and, index,
# new_ones, zeros, scalar_tensor, where, ge) is `attention_mask.build`; select_backward is
# `first_token.backward`.
MODELLED = {
    "mm", "addmm", "bmm", "native_layer_norm", "native_layer_norm_backward", "_softmax", "_softmax_backward_data",
    "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward", "gelu", "gelu_backward",
    "silu", "silu_backward", "tanh", "tanh_backward", "pow", "mean", "rsqrt", "neg", "cat", "sum", "add", "mul",
    "div", "div_", "bernoulli_", "clone", "embedding", "embedding_dense_backward", "constant_pad_nd",
    "slice_backward", "select_backward", "ge", "cos", "sin", "_to_copy", "arange", "le", "bitwise_and", "index", "new_ones", "zeros",
    "scalar_tensor", "where", "masked_fill", "eq", "ne", "lt", "gt", "full", "triu", "tril", "_foreach_add_",
    "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_", "_foreach_addcdiv_",
}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def aten_step(spec, b: int, s: int) -> collections.Counter:
    """ATen ops of one fp32 training step (eager attention, foreach AdamW), on CPU under FakeTensorMode."""
    from jobs.modeling import build_model, loss_of

    with torch._subclasses.fake_tensor.FakeTensorMode():
        module = build_model(spec.model_dump(mode="json"), "eager").train()
        batch = make_batch(spec, b, s, True)
        opt = torch.optim.AdamW(module.parameters(), foreach=True)
        counter = OpCounter()
        with counter:
            loss_of(module, batch).backward()
            opt.step()
    return counter.ops


def ours(kernels, *names: str, kind: str | None = None, phase: str | None = None) -> int:
    return sum(k.count for k in kernels if (kind is None or k.kind == kind) and (phase is None or k.phase == phase)
               and any(n in k.name for n in names))


@pytest.mark.parametrize("name", ["bert-cls", "gpt2-lm", "llama-lm"])
def test_kernel_list_accounts_for_every_aten_op(name):
    spec = SPECS[name]()
    b, s = 2, 24
    ops = aten_step(spec, b, s)
    unknown = set(ops) - FREE - MODELLED
    assert not unknown, f"ATen ops neither modelled nor named free: {sorted(unknown)}"

    ks = micro_kernels(spec, TrainConfig(batch_size=b, seq_len=s, attention="eager"), padded=True)
    gemms = sum(k.count for k in ks if k.gemm is not None)
    assert gemms == ops["mm"] + ops["addmm"] + ops["bmm"]
    t = spec.transformers[0]
    if t.norm == "layernorm":
        assert ours(ks, "LayerNorm", "ln_", "final_norm") == ops["native_layer_norm"] + \
            ops["native_layer_norm_backward"]
    else:  # RMSNorm in Python: one rsqrt per norm (its backward is pow/mul kernels)
        assert ours(ks, "rsqrt", phase="forward") == ops["rsqrt"]
    assert ours(ks, "softmax", kind="attention") == ops["_softmax"] + ops["_softmax_backward_data"]
    act = {"gelu": "gelu", "silu": "silu", "gelu_new": "tanh"}[t.hidden_act]
    assert ours(ks, "mlp.act.tanh" if act == "tanh" else "mlp.act") == ops[act] + ops[f"{act}_backward"]
    tables = 1 + (t.position_table > 0) + (spec.inputs.token_type_ids and t.type_vocab_size > 0)
    assert ours(ks, "embeddings.word.backward", "embeddings.position.backward",
                "embeddings.token_type.backward") == ops["embedding_dense_backward"] == tables
    assert ours(ks, "loss.log_softmax") == ops["_log_softmax"] + ops["_log_softmax_backward_data"]

    from planner.perf.throughput import parameter_counts

    n_params, n_tensors = parameter_counts(spec)
    opt = optimizer_kernels(n_params, n_tensors, "fp32", "adamw", "foreach")
    foreach = sum(v for k, v in ops.items() if k.startswith("_foreach_"))
    assert len(opt) == foreach - 1  # less the CPU-side step-counter increment


def test_memory_bound_config_prefers_bandwidth_over_flops():
    """A100-40GB (1,555 GB/s, 312 TFLOP/s fp16) against L40S (864 GB/s, 362 TFLOP/s): a step dominated by
    memory-bound kernels (small BERT layers, eager attention over long sequences) runs faster on the A100,
    and the breakdown says it is mostly bytes-bound."""
    from planner.hardware import get_instance
    from planner.models.catalog import get_model
    from planner.perf.throughput import predict_throughput

    spec = get_model("distilbert-base-uncased", num_labels=2)
    cfg = TrainConfig(batch_size=16, seq_len=512, precision="amp-fp16", attention="eager", parallelism="single")
    a100, l40s = get_instance("ml.p4d.24xlarge"), get_instance("ml.g6e.xlarge")
    assert l40s.gpu.peak_tflops["fp16"] > a100.gpu.peak_tflops["fp16"]
    assert a100.gpu.memory_bandwidth_gbs > l40s.gpu.memory_bandwidth_gbs
    fast, slow = predict_throughput(spec, cfg, a100), predict_throughput(spec, cfg, l40s)
    assert fast.samples_per_s > slow.samples_per_s
    assert slow.breakdown_s["bytes_bound_s"] > 0.5 * slow.step_time_s

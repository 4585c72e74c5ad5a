"""Issue 36's step-time kernel rules, each checked against what PyTorch or the library really runs.

- the eager attention's elementwise passes take the elementwise backward rule, whose bytes equal the ATen
  backward op's tensors (`_softmax_backward_data` reads the gradient and the output, writes one tensor), not
  the fused SDPA kernel's; the additive mask is read once per sample;
- CPU dropout is the three ops `bernoulli_`, `div_`, `mul` (Dropout.cpp `_dropout_impl`, seen here by a
  TorchDispatchMode), which a traced step's speed times as CUDA's one fused kernel;
- QLoRA: a double-quantized dequantization is three launches; a 4-bit Linear fed fp32 casts its output back
  to fp32 (a real bitsandbytes `Linear4bit` on the CPU returns its input's dtype); under checkpointing the
  adapters and the dequantizations of the recomputed part run again, up to the layer's last saving op.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from planner.perf.kernels import F32, _with, backward_of, elementwise, is_fused_attention  # noqa: E402
from planner.perf.micro_step import micro_kernels  # noqa: E402
from planner.program.records import OpRecord, TensorMeta  # noqa: E402
from planner.program.speed import cuda_rows  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402


class _Ops(TorchDispatchMode):
    """Every ATen op and the bytes of its tensor arguments and outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), sum(t.numel() * t.element_size() for t in tensors + outs)))
        return out


def test_eager_softmax_backward_moves_the_aten_ops_bytes():
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    y = torch.softmax(x, -1)
    with _Ops() as rec:
        y.backward(torch.ones_like(y))
    aten = next(b for name, b in rec.ops if "_softmax_backward_data" in name)
    fwd = _with(elementwise("attention.softmax", x.numel(), (F32,), (F32,), F32), kind="attention")
    assert not is_fused_attention(fwd)
    (bwd,) = backward_of(fwd)
    assert bwd.bytes == aten  # read dY and Y, write dX (the fused rule counted 16 bytes an element, not 12)


def test_fused_attention_keeps_its_rule_and_the_mask_is_read_once_per_sample():
    from planner.models.catalog import cached_model

    b, s = 4, 128
    model = cached_model("bert-base-uncased")
    cfg = TrainConfig(batch_size=b, seq_len=s, precision="amp-bf16", attention="eager", parallelism="single")
    ks = {k.name: k for k in micro_kernels(model, cfg)}
    add = ks["layer.attention.mask_add"]
    heads = model.transformers[0].num_heads
    assert add.bytes_read == b * heads * s * s * 2 + b * s * s * 4  # bf16 scores per head; one fp32 mask
    sdpa = micro_kernels(model, cfg.model_copy(update={"attention": "sdpa"}))
    fused = next(k for k in sdpa if k.name == "layer.attention.fused")
    back = next(k for k in sdpa if k.name == "layer.attention.fused.backward")
    assert is_fused_attention(fused) and back.bytes_read == fused.bytes_read + 2 * fused.bytes_written


def test_cpu_dropout_is_three_ops_and_is_timed_as_one_kernel():
    x = torch.randn(64, 32)
    with _Ops() as rec:
        torch.nn.functional.dropout(x, 0.1, training=True)
    names = [n.split(".")[-2] + "." + n.split(".")[-1] for n, _ in rec.ops if "empty" not in n]
    assert names == ["bernoulli_.float", "div_.Scalar", "mul.Tensor"]  # Dropout.cpp _dropout_impl
    meta = TensorMeta((64, 32), "bfloat16")

    def op(i, name, ins):
        return OpRecord(i, name, "forward", "drop", tuple(ins), (meta,))

    ops = [op(0, "aten.bernoulli_.float", [meta]), op(1, "aten.div_.Scalar", [meta]),
           op(2, "aten.mul.Tensor", [meta, meta]), op(3, "aten.add.Tensor", [meta, meta])]
    rows = cuda_rows(ops)
    assert [o.name for o, _ in rows] == ["aten.bernoulli_.float", "aten.add.Tensor"]
    assert rows[0][1][4] == 64 * 32 * (2 + 2 + 1)  # read x, write the output and a 1-byte mask
    feature = [op(0, "aten.bernoulli_.float", [TensorMeta((64, 1), "bfloat16")]), ops[1], ops[2]]
    assert len(cuda_rows([OpRecord(0, "aten.bernoulli_.float", "forward", "", (TensorMeta((64, 1), "bfloat16"),),
                                   (TensorMeta((64, 1), "bfloat16"),))] + feature[1:])) == 3  # noise of another shape


def test_linear4bit_returns_its_inputs_dtype():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4", blocksize=64)
    try:
        layer = layer.to("cpu")
        out = layer(torch.randn(4, 64))
    except (RuntimeError, NotImplementedError) as exc:  # a build without the CPU 4-bit ops
        pytest.skip(f"bitsandbytes 4-bit on CPU: {exc}")
    assert out.dtype == torch.float32  # nn/modules.py Linear4bit.forward: `.to(inp_dtype)`


def _qlora(ckpt: bool) -> list:
    from tests.test_flops import small_spec

    spec = small_spec("llama-2-7b", {})
    cfg = TrainConfig(batch_size=2, seq_len=64, precision="amp-bf16", attention="sdpa", parallelism="single",
                      lora_r=4, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), base_dtype="nf4",
                      lora_dropout=0.05, checkpointing=ckpt)
    return micro_kernels(spec, cfg)


def test_qlora_dequantize_launches_output_casts_and_recompute():
    plain, ckpt = _qlora(False), _qlora(True)
    deq = [k for k in plain if k.name.endswith(".dequantize")]
    assert deq and all(k.launches == 3 for k in deq)  # absmax blockwise dequantize, + offset, the 4-bit kernel
    casts = {k.name.removesuffix(".output_cast") for k in plain if k.name.endswith(".output_cast")}
    # fed fp32 (fp32 norms; the fp32 gate * up product): all but o_proj, which reads SDPA's 16-bit output
    assert casts == {k.name.removesuffix(".dequantize") for k in deq if ".o_proj." not in k.name}
    assert any(k.name == "mlp.down_proj.input_cast" for k in plain)
    assert not [k for k in plain if k.phase == "recompute"]
    again = {k.name.removesuffix(".recompute") for k in ckpt if k.phase == "recompute"}
    for k in deq:  # the MLP's down projection is after the layer's last saving op (gate * up): not recomputed
        assert (k.name in again) == (".down_proj." not in k.name), k.name
    assert {n for n in again if ".lora_" in n}  # the adapters run again too

"""NeMo AutoModel's MoE layer as it saves tensors for backward (issue 35: its published gpt-oss runs were
called OOM though they ran).

NeMo AutoModel's DeepEP experts (nemo_automodel/components/moe/experts.py @cb9765441e51, layers.py @2c236e081,
the code of the published runs) call Megatron's fused permutation (`MegatronMoEConfig(moe_permute_fusion=True,
moe_enable_deepep=True)`) and apply the routing probabilities inside the activation: Qwen3-MoE's
`weighted_bias_swiglu_impl` (Megatron's fused kernel, tests/test_moe_megatron.py) or gpt-oss's
`quick_geglu_deepep`, a `@torch.compile(fullgraph=True)` function. What a compiled region saves is what
inductor's min-cut partitioner keeps; that is checked here on the function as the source writes it, compiled
the way inductor partitions it (its decomposition table and min_cut_rematerialization_partition, the two
things torch/_inductor/compile_fx.py hands aot_autograd), without generating kernels.
"""

from __future__ import annotations

import pytest

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.memory.op_saved import op_saved
from planner.models import hf_config
from tests.test_moe import TINY

NBYTES = {"bfloat16": 2, "float32": 4, "int32": 4, "int64": 8, "bool": 1}


def quick_geglu_deepep(x, permuted_probs, alpha: float = 1.702, limit: float = 7.0, linear_offset: float = 1.0):
    """NVIDIA-NeMo/Automodel nemo_automodel/components/moe/experts.py @cb9765441e51 (layers.py @2c236e081 the
    same body), line for line; decorated there with `@torch.compile(fullgraph=True, ...)`."""
    import torch

    gate_out, up_out = x[..., ::2], x[..., 1::2]
    gate_out = gate_out.clamp(min=None, max=limit)
    up_out = up_out.clamp(min=-limit, max=limit)
    out_glu = gate_out * torch.sigmoid(alpha * gate_out)
    inter = out_glu * (up_out + linear_offset)
    return (inter * permuted_probs).to(x.dtype)


def _inductor_partitioned(fn):
    """`fn` compiled as inductor splits it into forward and backward: aot_autograd with inductor's
    decompositions and the min-cut partitioner, the graphs run as they are (no code generation: fast on CPU)."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def run_as_is(gm, _):
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward of one call (saved-tensor hooks)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    seen: dict[int, int] = {}

    def pack(t):
        seen[StorageWeakRef(t.untyped_storage()).cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.float().sum().backward()
    return sum(seen.values())


def _nemo_layer(model_type: str):
    """A tiny model's first layer under NeMo AutoModel's context: bf16, fused permutation and activation, its own
    eager router (Framework nemo-automodel: fused_moe, not fused_router)."""
    spec = hf_config.spec_from_hf_config(TINY[model_type], name=model_type)
    ctx = Ctx(2, 24, "bf16", "flash", "cuda", False, True, experts_16bit=True, fused_moe=True, fused_router=False,
              fused_norms=True, loss_fp32=False)
    layer = next(b for b in model_program(spec, ctx).blocks if b.role == "layer")
    return spec.transformers[0], ctx, {op.name: op for op in layer.ops}


@pytest.mark.parametrize("probs_grad", [False, True])
def test_compiled_quick_geglu_saves_what_the_planner_counts(probs_grad):
    """gpt-oss's expert activation under NeMo: the compiled region keeps its input (the gate_up output, 2·S·i)
    and the fp32 probabilities (DeepEP's, `dispatched_probs.dtype == torch.float32`), nothing of the clamps,
    sigmoid or products; the planner's activation op of a tiny gpt-oss layer under NeMo's context says the same
    bytes. Eager, the same function keeps several S·i tensors more (what transformers' clamped SwiGLU saves)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch._inductor.decomposition")
    t, ctx, ops = _nemo_layer("gpt_oss")
    act = ops["mlp.experts.act"]
    s, i = act.attrs["weighted"], t.moe_intermediate_size
    assert act.shapes["input"] == (s * i,)
    planner_bytes = sum(x.numel * NBYTES[x.dtype] for x in op_saved(act, ctx))

    torch.manual_seed(0)
    x = torch.randn(s, 2 * i, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(s, 1, dtype=torch.float32, requires_grad=probs_grad)
    compiled = _saved_bytes(_inductor_partitioned(quick_geglu_deepep), x, probs)
    assert compiled == planner_bytes == 2 * s * i * 2 + s * 4
    assert _saved_bytes(quick_geglu_deepep, x, probs) >= compiled + 2 * s * i * 2


def test_nemo_layer_keeps_an_eager_router_and_megatrons_permutation():
    """NeMo's Gate is its own eager module (gpt-oss: top-k of the logits, then a softmax over k), saving what
    transformers' router saves; the permutation is TE's row-id map (`permute(..., fused=True)` in
    _DeepepManager) and the unpermutation, without probabilities, saves nothing; the grouped GEMMs keep their
    16-bit inputs."""
    t, ctx, ops = _nemo_layer("gpt_oss")
    n, e, k, h, i = ctx.n, t.num_experts, t.experts_per_token, t.hidden_size, t.moe_intermediate_size
    s = n * k
    router = next(op for op in ops.values() if op.kind == "router")
    assert [(x.numel, x.dtype) for x in op_saved(router, ctx)] == [(n * h, "bfloat16"), (n * k, "int64"),
                                                                   (n * k, "bfloat16")]
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.permute"], ctx)] == [(n * (2 * e + 1), "int32")]
    assert op_saved(ops["mlp.experts.unpermute"], ctx) == []
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.gate_up"], ctx)] == [(s * h, "bfloat16")]
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.down"], ctx)] == [(s * i, "bfloat16")]


def test_published_gpt_oss_rows_run_the_recipes_that_produced_them():
    """The NeMo gpt-oss-20b row was published (2025-10-06) while its recipe checkpointed every block; the
    gpt-oss-120b row's batch and layout are the recipe of 2c236e081 (local batch 2, EP 64, no checkpointing).
    Each row cites the commit it reads."""
    from planner.probes.public_moe_fp8 import load_published

    rows = {r.id: r for r in load_published("moe")}
    small, big = rows["nemo-am-gpt-oss-20b"], rows["nemo-am-gpt-oss-120b"]
    assert small.train_config().checkpointing and "79d0ccfdb" in small.where and "8df18da35" in small.where
    cfg = big.train_config()
    assert (cfg.batch_size, cfg.grad_accum, cfg.ep, cfg.checkpointing) == (2, 4, 64, False)
    assert "2c236e081" in big.where


def test_compiled_quick_geglu_is_one_pointwise_region_and_the_planner_times_one_kernel():
    """Inductor fuses a region of pointwise ops over one iteration space into one kernel: the partitioned
    forward of quick_geglu_deepep holds only pointwise ops and views (no reduction, no matmul), so NeMo's
    activation is one pass each way, reading the gate_up output and the probabilities and writing the product;
    the planner's kernel rule for the weighted activation says so (and the fused unpermutation is one
    reduction pass, TE RMSNorm one pass), where transformers' clamped SwiGLU is seven."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch._inductor.decomposition")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from planner.ir.interpret import apply, load_rules

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm), decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    x = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(quick_geglu_deepep, backend=backend, fullgraph=True, dynamic=False)(x, torch.rand(16, 1)).float().sum().backward()
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    views = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.alias.default}
    assert ops and all(t in views or torch.Tag.pointwise in t.tags for t in ops), ops

    load_rules()
    t, ctx, layer = _nemo_layer("gpt_oss")
    act = layer["mlp.experts.act"]
    s, n = act.attrs["weighted"], act.shapes["input"][0]
    (k,) = apply("kernels", act, ctx)
    assert (k.bytes_read, k.bytes_written) == (2 * n * 2 + 4 * s, n * 2)
    (unperm,) = apply("kernels", layer["mlp.experts.unpermute"], ctx)
    assert unperm.kind == "memory_bound"
    norm = layer["post_attention_layernorm"]
    rows, width = norm.shapes["input"]
    (te,) = apply("kernels", norm, ctx)
    assert (te.bytes_read, te.bytes_written) == (rows * width * 2, rows * width * 2 + 4 * rows)

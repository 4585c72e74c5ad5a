"""Layer forms: each emits the ops of one block of a hand-modelled family (planner.ir.ops), once, for every
interpreter (parameters, FLOPs, kernels, saved memory) to read.

One file per layer form (`post_norm_encoder.py`, `pre_norm_conv1d.py`, `pre_norm_gated.py`), each registering
its layer with `@layer_form(name)`; the blocks every form shares (embeddings, final norm, pooler, heads, the
loss, the multimodal model's dense and batch-norm blocks) are in `common.py`. The forms are found by listing
this package, so a new layer form is one file here, plus its name in `traits.LayerForm` and the family
record that uses it (three files); a family whose layers have an existing form is one record in
planner/families/registry.py (with its config.json reader in planner.models.hf_config).

Why the program is built per context record (planner.ir.context.Ctx): the ops a layer runs depend on it
(which attention kernel, whether HF builds a 4-D mask, the dtypes under autocast), as they do in PyTorch.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner import caches
from planner.families import family
from planner.families.traits import Family
from planner.identity_cache import per_object
from planner.ir.context import Ctx
from planner.ir.ops import Op, Program, ProgramBlock, weight_matmul
from planner.models.blocks import Block, model_blocks
from planner.spec import ModelSpec, TransformerSpec


@dataclass(frozen=True)
class LayerArgs:
    """What a form needs to emit one transformer layer."""

    spec: TransformerSpec
    traits: Family
    ctx: Ctx
    index: int  # the layer's index (Llama's first layer saves the rotary tables)
    prefix: str  # the parameter names' prefix of this layer, e.g. "transformer.h.3."


LayerFn = Callable[[LayerArgs], list[Op]]
FORMS: dict[str, LayerFn] = {}
# Forms whose module registers its norms after the rest (LlamaDecoderLayer: self_attn, mlp, then both norms),
# so its parameters' registration order differs from the run order the program lists them in.
NORMS_REGISTERED_LAST: set[str] = set()


def layer_form(name: str, norms_registered_last: bool = False) -> Callable[[LayerFn], LayerFn]:
    """Decorator: `fn` emits the ops of one layer of form `name` (a traits.LayerForm). `norms_registered_last`:
    the layer's module registers its norms after its other submodules (see `layer_parameter_shapes`)."""
    def put(fn: LayerFn) -> LayerFn:
        FORMS[name] = fn
        if norms_registered_last:
            NORMS_REGISTERED_LAST.add(name)
        return fn

    return put


def load_forms() -> dict[str, LayerFn]:
    """Import every module of this package (each form registers itself); once per process."""
    if not _FORMS_LOADED:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _FORMS_LOADED.append(True)
    return FORMS


_FORMS_LOADED: list[bool] = []


def root_prefix(model: ModelSpec, block: Block) -> str:
    """Where the block's module sits in the whole model: the model itself for a one-transformer model
    (transformers' *For* classes), `component.index.` inside the multimodal model's nn.Sequential parts."""
    if len(model.components) == 1 and len(model.components[0].layers) == 1:
        return ""
    comp = next(c for c in model.components if c.name == block.component)
    layer_index = next(i for i, layer in enumerate(comp.layers) if layer is block.layer)
    return f"{comp.name}.{layer_index}."


def base_prefix(model: ModelSpec, block: Block, spec: TransformerSpec) -> str:
    """The base model's prefix: `bert.`, `transformer.`, `model.` under a head; none for a bare base model."""
    root = root_prefix(model, block)
    return root + (f"{family(spec.family).base_prefix}." if spec.head != "base" else "")


def block_ops(block: Block, model: ModelSpec, ctx: Ctx) -> list[Op]:
    """The ops of one block of planner.models.blocks, with the transforms the context asks for (FP8 Linears,
    torch.compile: planner.ir.transforms.for_context)."""
    from planner.ir.transforms import for_context

    ops = _block_ops(block, model, ctx)
    return for_context(ops, ctx, block.role) if ctx.fp8 or ctx.compile else ops


def _block_ops(block: Block, model: ModelSpec, ctx: Ctx) -> list[Op]:
    from planner.families.forms import common

    layer = block.layer
    if not isinstance(layer, TransformerSpec):
        return common.dense_ops(block, model, ctx, root_prefix(model, block))
    traits = family(layer.family)
    base = base_prefix(model, block, layer)
    if block.role == "layer":
        forms = FORMS or load_forms()
        args = LayerArgs(layer, traits, ctx, block.index, base + traits.layer_prefix.format(i=block.index))
        return forms[traits.layer](args)
    if block.role == "embeddings":
        return common.embedding_ops(layer, traits, ctx, base, model.inputs.token_type_ids)
    if block.role == "final_norm":
        return common.final_norm_ops(layer, traits, ctx, base)
    if block.role == "pooler":
        return common.pooler_ops(layer, ctx, base)
    return common.head_ops(layer, traits, ctx, root_prefix(model, block))


def model_program(model: ModelSpec, ctx: Ctx) -> Program:
    """Every block's ops in forward order, then a "loss" block (as planner.memory.activations lists them).
    Made once per (model, context) and kept: the estimate's JSON and the tests read it."""
    table = per_object(_PROGRAMS, model, lambda m: {})
    hit = table.get(ctx)
    if hit is None:
        from planner.families.forms import common

        load_forms()
        blocks = [ProgramBlock(b.name, b.role, tuple(block_ops(b, model, ctx))) for b in model_blocks(model)]
        blocks.append(ProgramBlock("loss", "loss", tuple(common.loss_ops(model, ctx))))
        hit = table[ctx] = Program(tuple(blocks))
    return hit


_PROGRAMS: dict[int, dict] = caches.table("planner.families.forms._PROGRAMS", scope="step",
    key="ModelSpec identity (per_object) -> {Ctx: Program}")


# The context the parameter list is read under: a model's parameter tensors do not depend on the batch, the
# precision or the kernel (only its ops do), so any context gives the same list.
PARAMETER_CONTEXT = Ctx(1, 1, "fp32", "sdpa", "cuda", False)


def parameter_tensors(model: ModelSpec) -> tuple:
    """Every parameter tensor of the model (planner.ir.ops.Param), as `module.named_parameters()` lists them
    (tied tensors once): the program's, read once per model."""
    return per_object(_PARAMETERS, model, lambda m: tuple(model_program(m, PARAMETER_CONTEXT).params))


_PARAMETERS: dict[int, tuple] = caches.table("planner.families.forms._PARAMETERS", scope="model",
    key="ModelSpec identity (per_object): its parameter tensors")


# A context that tells a token-wise Linear (b·s rows) from a sample-wise one (b rows) by its row count; the
# linear ops themselves do not depend on the micro-batch or the precision, only on the tensor-parallel degree
# (one rank's widths: `probe`). Without sequence parallelism, so that every token-wise op keeps n rows.
_PROBE = Ctx(2, 3, "fp32", "sdpa", "cuda", False)
PROBE_CTX = _PROBE  # a context without parallelism, for readers of a layer's modules (planner.adapters.targets)


def probe(tp: int = 1) -> Ctx:
    """The probe context of one tensor-parallel rank of `tp` (the forms emit that rank's widths)."""
    return _PROBE if tp == 1 else replace(_PROBE, tp=tp)


@dataclass(frozen=True)
class BlockMatmuls:
    """The matmuls of one transformer block's program, read once per layer spec, role, layer kind and
    tensor-parallel degree."""

    linears: tuple[tuple[bool, int, int, bool], ...]  # (per token, not per sample; in, out, bias), forward order
    attention: bool  # the block runs an attention op (its score matmuls: planner.perf.flops)
    # (weight, bias) elements of every matmul autocast casts the parameters of, in forward order: the `linear`
    # ops and a mixture-of-experts router (F.linear); the experts' grouped GEMMs are not autocast
    # (transformers' `_grouped_mm` casts the input to the weights instead: forms/moe_gated.py)
    casts: tuple[tuple[int, int], ...] = ()


def _layer_ops(layer: TransformerSpec, index: int, ctx: Ctx) -> list[Op]:
    traits = family(layer.family)
    return (FORMS or load_forms())[traits.layer](LayerArgs(layer, traits, ctx, index, ""))


def block_matmuls(block: Block, tp: int = 1) -> BlockMatmuls:
    """The `linear`, router and attention ops of one transformer block (embeddings, layer, final norm,
    pooler or head) on one rank of `tp` tensor-parallel ranks: what autocast casts
    (planner.memory.activations.linear_params) and what planner.perf.flops counts."""
    layer = block.layer
    assert isinstance(layer, TransformerSpec)
    sparse = block.role == "layer" and layer.moe and layer.sparse_layer(block.index)
    key = (id(layer), block.role, block.index == 0, sparse, tp)
    hit = _MATMULS.get(key)
    if hit is not None and hit[0] is layer:
        return hit[1]
    from planner.families.forms import common

    traits, ctx = family(layer.family), probe(tp)
    if block.role == "layer":
        ops = _layer_ops(layer, block.index, ctx)
    elif block.role == "pooler":
        ops = common.pooler_ops(layer, ctx, "")
    elif block.role == "head":
        ops = common.head_ops(layer, traits, ctx, "")
    else:
        ops = []
    linears = tuple((op.shapes["input"][0] == ctx.n, op.shapes["input"][1], op.shapes["output"][1],
                     bool(op.attrs["bias"])) for op in ops if op.kind == "linear")
    casts = []
    for op in ops:
        shape = weight_matmul(op)
        if shape is not None:
            n_in, n_out = shape
            casts.append((n_in * n_out, n_out if op.attrs["bias"] else 0))
    out = BlockMatmuls(linears, any(op.kind.startswith("attention_") for op in ops), tuple(casts))
    _MATMULS[key] = (layer, out)
    return out


_MATMULS: dict[tuple, tuple] = caches.table("planner.families.forms._MATMULS", scope="model",
    key="(TransformerSpec identity, block role, first layer, sparse MoE layer, tp) -> (spec, BlockMatmuls)")


def block_linears(block: Block, tp: int = 1) -> list[tuple[int, int]]:
    """(weight, bias) elements of each matmul of one transformer block whose parameters autocast casts (its
    `linear` ops and an MoE router), in forward order, on one rank of `tp` tensor-parallel ranks (column-
    parallel weights and biases / tp, row-parallel weights / tp with their bias whole, the vocabulary / tp:
    the forms' per-rank widths): planner.memory.activations.linear_params."""
    return list(block_matmuls(block, tp).casts)


def layer_parameter_shapes(spec: TransformerSpec, tp: int = 1, index: int = 1) -> tuple[tuple[int, ...], ...]:
    """The shapes of one layer's parameter tensors in registration order (`module.parameters()`, what the
    optimizer and planner.models.params list): the layer form's ops' parameters, in run order except that a
    form registering its norms last (`NORMS_REGISTERED_LAST`) lists them last. With `tp` > 1 one tensor-
    parallel rank's shards, as the form emits that rank's ops (planner.memory.stages reads them). `index`: the
    layer's index where the form's layers differ (a mixture-of-experts model's dense and sparse layers).
    Cached per layer spec, tp and layer kind."""
    sparse = spec.moe and spec.sparse_layer(index)
    key = (id(spec), tp, sparse)
    hit = _LAYER_SHAPES.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    traits = family(spec.family)
    ops = _layer_ops(spec, index, probe(tp))
    params = [(op.kind, p.shape) for op in ops for p in op.params]
    if traits.layer in NORMS_REGISTERED_LAST:
        params = ([x for x in params if x[0] not in ("layer_norm", "rms_norm")]
                  + [x for x in params if x[0] in ("layer_norm", "rms_norm")])
    out = tuple(shape for _, shape in params)
    _LAYER_SHAPES[key] = (spec, out)
    return out


_LAYER_SHAPES: dict[tuple, tuple] = caches.table("planner.families.forms._LAYER_SHAPES", scope="model",
    key="(TransformerSpec identity, tp, sparse MoE layer) -> (spec, its layer's parameter shapes in registration "
        "order)")


def block_parameter_shapes(block: Block) -> tuple[tuple[int, ...], ...]:
    """The parameter tensor shapes of a transformer model's embeddings, final norm, pooler or head block in
    registration order (`module.parameters()`): the block's ops' parameters, which common.py lists in that
    order (RoBERTa's position table after its LayerNorm, the BERT/RoBERTa masked-LM head's own bias first; a
    tied table once, with the embeddings). planner.models.params counts these blocks from here (issue 33: its
    per-head formulas were another copy). Cached per layer spec and role."""
    from planner.families.forms import common

    layer = block.layer
    assert isinstance(layer, TransformerSpec) and block.role != "layer"
    key = (id(layer), block.role, block.index == 0)
    hit = _BLOCK_SHAPES.get(key)
    if hit is not None and hit[0] is layer:
        return hit[1]
    traits, ctx = family(layer.family), PARAMETER_CONTEXT
    if block.role == "embeddings":
        ops = common.embedding_ops(layer, traits, ctx, "", False)
    elif block.role == "final_norm":
        ops = common.final_norm_ops(layer, traits, ctx, "")
    elif block.role == "pooler":
        ops = common.pooler_ops(layer, ctx, "")
    elif block.role == "head":
        ops = common.head_ops(layer, traits, ctx, "")
    else:
        raise ValueError(f"block {block.name}: role {block.role!r} has no parameter shapes")
    out = tuple(p.shape for op in ops for p in op.params)
    _BLOCK_SHAPES[key] = (layer, out)
    return out


_BLOCK_SHAPES: dict[tuple, tuple] = caches.table("planner.families.forms._BLOCK_SHAPES", scope="model",
    key="(TransformerSpec identity, block role, first) -> (spec, the block's parameter shapes in registration order)")

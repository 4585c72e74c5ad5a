"""A model's linear modules by their transformers module names, and peft's rules for which of them get adapters.

Why names: peft picks LoRA targets by module name (`check_target_module_exists`: a target key matches a module
named exactly so or ending in "." + key), so `--lora-targets q_proj,v_proj` must be matched against the same
names transformers gives its modules (tests/test_lora.py compares every list with `named_modules()` of the
real classes). GPT-2's attention and MLP are `Conv1D` (weight stored (in, out)); peft adapts them as linear.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError, closest
from planner.families import FAMILIES, Linear, family
from planner.models.blocks import Block, model_blocks
from planner.spec import DenseSpec, ModelSpec, TransformerSpec

ALL_LINEAR = "all-linear"  # peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND
# Mixture-of-experts layers keep their experts as 3-D parameters (transformers 5 `*Experts.gate_up_proj`,
# `.down_proj`), not nn.Linear modules, so peft adapts them through `LoraConfig(target_parameters=...)` (peft 0.21
# tuners/lora/layer.py `ParamWrapper`), not target_modules. `--lora-targets experts` names both (the planner's
# shorthand for target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]); "experts.gate_up_proj"
# or "experts.down_proj" names one, as peft matches a target parameter by its name's suffix.
EXPERTS = "experts"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")

# peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft 0.18): the targets LoraConfig
# uses when target_modules is None. DistilBERT has no entry: peft asks for target_modules. Each family's
# record (planner.families) carries its own; these views keep the old names.
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    name: f.lora_default_targets for name, f in FAMILIES.items() if f.lora_default_targets is not None}

# The attribute transformers' *For* classes give the base model (`base_model_prefix`).
BASE_PREFIX = {name: f.base_prefix for name, f in FAMILIES.items()}


@dataclass(frozen=True)
class LinearModule:
    """One nn.Linear / Conv1D: its full module name, fan-in, fan-out and bias.

    `output`: the model's output embeddings (`get_output_embeddings()`), which peft's all-linear leaves out.
    `last`: the module of the model's last parameter, which transformers' bitsandbytes integration keeps
    unquantized (quantizers/base.py `get_keys_to_not_convert`), like the output embeddings.
    `head`: a sequence-classification head module that peft's SEQ_CLS task trains in full (modules_to_save).
    """

    name: str
    n_in: int
    n_out: int
    bias: bool
    conv1d: bool = False
    output: bool = False
    last: bool = False
    head: bool = False

    @property
    def weight_numel(self) -> int:
        return self.n_in * self.n_out


@dataclass(frozen=True)
class ExpertWeight:
    """One fused expert weight (E, ·, ·) of an MoE layer, as peft's ParamWrapper sees it: `n_in` / `n_out` the
    width each expert's matmul reads and writes (ParamWrapper swaps the stored (E, out, in) to (in, out) unless
    the experts are stored transposed, gpt-oss's (E, in, out)); its adapter is lora_A (r·E, n_in) and lora_B
    (n_out, r·E): r · E · (n_in + n_out) trainable parameters."""

    name: str  # the parameter's full name, e.g. model.layers.1.mlp.experts.gate_up_proj
    experts: int
    n_in: int
    n_out: int

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def numel(self) -> int:
        return self.experts * self.n_in * self.n_out


def is_expert_target(target: str) -> bool:
    """A --lora-targets entry that names fused expert weights (peft target_parameters), not modules."""
    return target == EXPERTS or any(target == f"{EXPERTS}.{w}" or target.endswith(f".{EXPERTS}.{w}")
                                    for w in EXPERT_WEIGHTS)


def _prefix(component: str, spec: TransformerSpec, single: bool) -> str:
    """Module name prefix of the base model: "model." for LlamaForCausalLM, "" for a bare BertModel; a model of
    several components (the multimodal one) names each by its component."""
    own = "" if spec.head == "base" else BASE_PREFIX[spec.family] + "."
    return own if single else f"{component}.{own}"


def _widths(spec: TransformerSpec) -> dict[str, int]:
    """A layer's sizes by the names the family records use (planner.families.traits.Width)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"h": spec.hidden_size, "q": q, "kv": kv, "qkv": q + 2 * kv, "i": spec.intermediate_size,
            "labels": spec.num_labels, "vocab": spec.vocab_size}


def _modules(spec: TransformerSpec, prefix: str, rows: tuple[Linear, ...]) -> list[LinearModule]:
    """The family record's linear rows as this model's modules: widths and biases filled in."""
    w = _widths(spec)
    bias = {"yes": True, "no": False, "attention": spec.attention_bias, "mlp": spec.mlp_bias}
    return [LinearModule(prefix + r.name, w[r.n_in], w[r.n_out], bias[r.bias], conv1d=r.conv1d, output=r.output,
                         last=r.last, head=r.head) for r in rows]


def _layer(spec: TransformerSpec, base: str, i: int) -> list[LinearModule]:
    traits = family(spec.family)
    if spec.moe:
        return _program_linears(spec, base + traits.layer_prefix.format(i=i), i)
    return _modules(spec, base + traits.layer_prefix.format(i=i), traits.layer_linears)


def _layer_ops(spec: TransformerSpec, prefix: str, i: int) -> list:
    from planner.families.forms import PROBE_CTX, LayerArgs, load_forms

    traits = family(spec.family)
    return load_forms()[traits.layer](LayerArgs(spec, traits, PROBE_CTX, i, prefix))


def _program_linears(spec: TransformerSpec, prefix: str, i: int) -> list[LinearModule]:
    """A mixture-of-experts layer's nn.Linear modules, read from its program's `linear` ops (one rank's view of
    nothing: the probe context has no tensor or expert parallelism): which exist depends on the layer (a
    sparse layer has the router and the fused experts, which are not nn.Linear, plus any shared expert; a
    dense one Llama's MLP) and on the attention (multi-head latent attention's q_a/q_b/kv_a/kv_b/o), so the
    family's fixed rows do not describe it. Widths come from each weight's (out, in) shape."""
    out = []
    for op in _layer_ops(spec, prefix, i):
        if op.kind != "linear":
            continue
        weight = next(p for p in op.params if p.name.endswith(".weight"))
        out.append(LinearModule(weight.name[: -len(".weight")], weight.shape[1], weight.shape[0],
                                any(p.name.endswith(".bias") for p in op.params)))
    return out


def _head(spec: TransformerSpec, top: str, base: str) -> list[LinearModule]:
    """The head's linear modules (the family record's classifier / LM-head Linears, which the head's ops in
    planner/families/forms/common.py `head_ops` emit)."""
    traits = family(spec.family)
    if spec.head == "sequence-classification":
        return _modules(spec, top, traits.classifier_linears)
    if spec.head not in ("masked-lm", "causal-lm"):
        return []
    return _modules(spec, top, traits.lm_head_linears)


def block_linears(block: Block, single: bool = True, root: str | None = None) -> list[LinearModule]:
    """The linear modules of one block (`planner.models.blocks`), named as transformers names them.

    The output head's matrix is listed even when tied to the token table (it is one module); peft's
    all-linear and bitsandbytes both leave it out (`output`). `single`: the model has one component.
    `root`: where the block's transformer sits in the whole model (planner.families.forms.root_prefix: in the
    multimodal model `component.index.`, the nn.Sequential part, as `named_modules()` names it).
    """
    layer = block.layer
    if isinstance(layer, DenseSpec):
        return [LinearModule(f"{block.component}.{block.index}", layer.in_features, layer.out_features,
                             layer.bias)]
    if not isinstance(layer, TransformerSpec):
        return []
    base = _prefix(block.component, layer, single)
    top = "" if single else f"{block.component}."
    if root is not None:
        top, base = root, root + base[len(top):]
    if block.role == "layer":
        return _layer(layer, base, block.index)
    if block.role == "pooler":
        return [LinearModule(f"{base}pooler.dense", layer.hidden_size, layer.hidden_size, True)]
    if block.role == "head":
        return _head(layer, top, base)
    return []


def block_expert_weights(block: Block, single: bool = True, root: str | None = None) -> list[ExpertWeight]:
    """The fused expert weights of one block (a sparse MoE layer's `expert_gemm` ops: gate_up then down, the
    order the module registers them), named as `named_parameters()` names them; none elsewhere."""
    layer = block.layer
    if block.role != "layer" or not isinstance(layer, TransformerSpec) or not layer.sparse_layer(block.index):
        return []
    base = _prefix(block.component, layer, single)
    if root is not None:
        top = "" if single else f"{block.component}."
        base = root + base[len(top):]
    prefix = base + family(layer.family).layer_prefix.format(i=block.index)
    return [ExpertWeight(op.params[0].name, op.params[0].shape[0], op.shapes["input"][1], op.shapes["output"][1])
            for op in _layer_ops(layer, prefix, block.index) if op.kind == "expert_gemm"]


def model_expert_weights(model: ModelSpec) -> dict[str, list[ExpertWeight]]:
    """Block name -> its fused expert weights (empty for every block of a model without experts)."""
    from planner.families.forms import root_prefix

    single = len(model.components) == 1
    if not any(t.moe for t in model.transformers):
        return {b.name: [] for b in model_blocks(model)}
    return {b.name: block_expert_weights(b, single, root_prefix(model, b)) for b in model_blocks(model)}


def adapted_experts(model: ModelSpec, targets: tuple[str, ...]) -> dict[str, list[ExpertWeight]]:
    """Block name -> the fused expert weights that get a LoRA adapter (peft target_parameters); a target that
    names experts on a model without them is a PlannerError naming it."""
    wanted = [t for t in targets if is_expert_target(t)]
    weights = model_expert_weights(model)
    if not wanted:
        return {b: [] for b in weights}
    if not any(weights.values()):
        raise PlannerError("--lora-targets", ",".join(wanted), f"module names: {model.name} has no fused experts")

    def chosen(w: ExpertWeight) -> bool:
        return any(t == EXPERTS or w.name == t or w.name.endswith("." + t) for t in wanted)

    return {b: [w for w in ws if chosen(w)] for b, ws in weights.items()}


def model_linears(model: ModelSpec) -> dict[str, list[LinearModule]]:
    """Block name -> its linear modules, in forward order."""
    from planner.families.forms import root_prefix

    single = len(model.components) == 1
    return {b.name: block_linears(b, single, root_prefix(model, b)) for b in model_blocks(model)}


def default_targets(model: ModelSpec) -> tuple[str, ...]:
    """peft's default target_modules for the model type (its first transformer)."""
    families = [t.family for t in model.transformers]
    if not families or families[0] not in DEFAULT_TARGETS:
        raise PlannerError("--lora-targets", "", f"name the modules to adapt, or {ALL_LINEAR} (peft has no "
                           f"default for {model.name})")
    return DEFAULT_TARGETS[families[0]]


def matches(name: str, target: str) -> bool:
    """peft `check_target_module_exists` for a list of names: the module name is the key or ends with '.key'."""
    return name == target or name.endswith("." + target)


def all_linear(module: LinearModule) -> bool:
    """peft `_maybe_include_all_linear_layers`: every Linear/Conv1D except the output embeddings (the
    sequence-classification head is left out by `adapted`)."""
    return not module.output


def _check_peft_retargeting(model: ModelSpec, targets: tuple[str, ...]) -> None:
    """peft 0.21 rewrites some target names on some MoE model types (traits.Family.peft_retargeted): gate_proj
    and up_proj become the fused experts' gate_up_proj at rank 2r, down_proj their down_proj, gate the router's
    weight, and those names then adapt no shared-expert or dense-layer Linear; all-linear is resolved to module
    names first, so it is rewritten too. The planner does not model that rewrite: one line saying what to
    give instead."""
    for t in model.transformers:
        renamed = family(t.family).peft_retargeted
        hit = [x for x in targets if x == ALL_LINEAR or any(x == r or x.endswith("." + r) for r in renamed)]
        if renamed and hit:
            raise PlannerError("--lora-targets", ",".join(hit), f"attention modules and/or {EXPERTS} for "
                               f"{t.family} (peft 0.21 turns {', '.join(renamed)} and {ALL_LINEAR} into fused-"
                               "expert and router parameters at other ranks, not modelled)")


def adapted(model: ModelSpec, targets: tuple[str, ...]) -> dict[str, list[LinearModule]]:
    """Block name -> the linear modules that get a LoRA adapter; an unknown target is a PlannerError naming it.

    The sequence-classification head is trained in full (peft's SEQ_CLS modules_to_save), so a LoRA adapter is
    never put on it here.
    """
    linears = model_linears(model)
    names = [m.name for ms in linears.values() for m in ms]
    targets = tuple(t for t in targets if not is_expert_target(t))  # fused experts: `adapted_experts`
    _check_peft_retargeting(model, targets)
    if targets == (ALL_LINEAR,):
        return {b: [m for m in ms if all_linear(m) and not m.head] for b, ms in linears.items()}
    if ALL_LINEAR in targets:
        raise PlannerError("--lora-targets", ",".join(targets), f"{ALL_LINEAR} alone (or with {EXPERTS}), or "
                           "module names")
    for t in targets:
        if not any(matches(n, t) for n in names):
            short = sorted({n.rsplit(".", 1)[-1] for n in names})
            near = closest(t, short)
            hint = f"did you mean {', '.join(near)}?" if near else f"{model.name} has {', '.join(short)}"
            extra = f", or {EXPERTS} for the fused experts" if any(t.moe for t in model.transformers) else ""
            raise PlannerError("--lora-targets", t, f"no such module; {hint} (or {ALL_LINEAR}{extra})")
    return {b: [m for m in ms if not m.head and any(matches(m.name, t) for t in targets)]
            for b, ms in linears.items()}

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
    return _modules(spec, base + traits.layer_prefix.format(i=i), traits.layer_linears)


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


def adapted(model: ModelSpec, targets: tuple[str, ...]) -> dict[str, list[LinearModule]]:
    """Block name -> the linear modules that get a LoRA adapter; an unknown target is a PlannerError naming it.

    The sequence-classification head is trained in full (peft's SEQ_CLS modules_to_save), so a LoRA adapter is
    never put on it here.
    """
    linears = model_linears(model)
    names = [m.name for ms in linears.values() for m in ms]
    if targets == (ALL_LINEAR,):
        return {b: [m for m in ms if all_linear(m) and not m.head] for b, ms in linears.items()}
    if ALL_LINEAR in targets:
        raise PlannerError("--lora-targets", ",".join(targets), f"{ALL_LINEAR} alone, or module names")
    for t in targets:
        if not any(matches(n, t) for n in names):
            short = sorted({n.rsplit(".", 1)[-1] for n in names})
            near = closest(t, short)
            hint = f"did you mean {', '.join(near)}?" if near else f"{model.name} has {', '.join(short)}"
            raise PlannerError("--lora-targets", t, f"no such module; {hint} (or {ALL_LINEAR})")
    return {b: [m for m in ms if not m.head and any(matches(m.name, t) for t in targets)]
            for b, ms in linears.items()}

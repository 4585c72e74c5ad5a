"""A model as the ordered list of blocks that a training step walks through.

Parameter counts, saved activations, FLOPs and the memory timeline are all functions of a block, so
they share this one enumeration and agree on names (e.g. "TextBertBase.layer.3").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner import caches
from planner.families import family
from planner.identity_cache import per_object
from planner.spec import BatchNormSpec, DenseSpec, ModelSpec, TransformerSpec

Role = Literal["embeddings", "layer", "final_norm", "pooler", "head", "dense", "batchnorm"]


@dataclass(frozen=True)
class Block:
    name: str
    component: str
    role: Role
    layer: TransformerSpec | DenseSpec | BatchNormSpec
    index: int = 0


def _final_norm(spec: TransformerSpec) -> bool:
    """Pre-norm decoders (GPT-2 ln_f, Llama norm) end with a norm; post-norm encoders do not."""
    return family(spec.family).decoder


def transformer_blocks(component: str, spec: TransformerSpec) -> list[Block]:
    blocks = [Block(f"{component}.embeddings", component, "embeddings", spec)]
    blocks += [Block(f"{component}.layer.{i}", component, "layer", spec, i) for i in range(spec.num_layers)]
    if _final_norm(spec):
        blocks.append(Block(f"{component}.final_norm", component, "final_norm", spec))
    if spec.pooler:
        blocks.append(Block(f"{component}.pooler", component, "pooler", spec))
    if spec.head != "base":
        blocks.append(Block(f"{component}.head", component, "head", spec))
    return blocks


def model_blocks(model: ModelSpec) -> tuple[Block, ...]:
    """Blocks in forward order; backward visits them in reverse. Made once per `components` (an estimate walks
    them several times: activations, FLOPs, parameter counts)."""
    return per_object(_BLOCKS, model.components, _blocks)


_BLOCKS: dict[int, tuple] = caches.table("planner.models.blocks._BLOCKS", scope="model",
    key="ModelSpec.components identity (per_object): its blocks")  # ModelSpec.components -> its blocks (`per_object`)


def _blocks(components: tuple) -> tuple[Block, ...]:
    blocks: list[Block] = []
    for component in components:
        for i, layer in enumerate(component.layers):
            if isinstance(layer, TransformerSpec):
                blocks += transformer_blocks(component.name, layer)
            else:
                role: Role = "dense" if isinstance(layer, DenseSpec) else "batchnorm"
                blocks.append(Block(f"{component.name}.{i}.{layer.kind}", component.name, role, layer, i))
    return tuple(blocks)

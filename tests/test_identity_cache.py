"""What is derived from a model's layers is kept per object, never served to another object."""

from __future__ import annotations

from planner import identity_cache
from planner.models.blocks import model_blocks
from planner.models.catalog import cached_model
from planner.models.params import model_gradient_tensor_shapes


def test_a_copy_with_other_layers_gets_its_own_blocks_layers_and_shapes():
    model = cached_model("multimodal-bert")
    text_only = model.model_copy(update={"components": tuple(c for c in model.components
                                                             if any(layer.kind == "transformer" for layer in c.layers))})
    assert model_blocks(model) is model_blocks(model)  # made once
    assert len(model_blocks(text_only)) < len(model_blocks(model))
    assert len(model_gradient_tensor_shapes(text_only)) < len(model_gradient_tensor_shapes(model))
    assert text_only.transformers == model.transformers and len(text_only.components) < len(model.components)
    assert model.model_copy(update={"components": ()}).transformers == ()


def test_a_full_table_starts_again(monkeypatch):
    monkeypatch.setattr(identity_cache, "LIMIT", 2)
    table: dict = {}
    objs = [object() for _ in range(3)]
    made = [identity_cache.per_object(table, o, id) for o in objs]
    assert made == [id(o) for o in objs] and len(table) == 1  # cleared when the third came
    assert identity_cache.per_object(table, objs[2], lambda o: "again") == id(objs[2])  # still kept

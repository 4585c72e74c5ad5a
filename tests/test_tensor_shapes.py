"""Per-tensor parameter shapes against the real modules that jobs/modeling.py builds (on `meta`: shapes only).

The lists must match `module.parameters()` in order too, since the Adafactor peak depends on adjacent tensors.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from jobs import modeling  # noqa: E402
from planner.models import hf_config  # noqa: E402
from planner.models.blocks import model_blocks  # noqa: E402
from planner.models.catalog import get_model, list_models  # noqa: E402
from planner.models.params import (  # noqa: E402
    block_parameters,
    block_tensor_shapes,
    model_gradient_tensor_shapes,
    model_tensor_shapes,
)
from planner.spec import ModelSpec  # noqa: E402
from tests.test_params import MULTIMODAL_CASES, UNUSUAL, random_configs  # noqa: E402


def real_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    module = modeling.build_model(spec.model_dump(mode="json"), device="meta")
    return [tuple(p.shape) for p in module.parameters()]  # tied parameters appear once


def check(spec: ModelSpec) -> None:
    for block in model_blocks(spec):
        assert sum(math.prod(s) for s in block_tensor_shapes(block)) == block_parameters(block), block.name
    real = real_shapes(spec)
    assert sorted(model_tensor_shapes(spec)) == sorted(real)  # the multiset
    assert model_tensor_shapes(spec) == real  # and the order


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("head", [None, "base", "sequence-classification"])
def test_catalog_models_match_module_parameters(name, head):
    if head is not None and name == "multimodal-bert":
        pytest.skip("the multimodal model has one fixed head")
    check(get_model(name) if head is None else get_model(name, head=head))


@pytest.mark.parametrize("options", MULTIMODAL_CASES)
def test_multimodal_options(options):
    check(get_model("multimodal-bert", **options))


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_unusual_configs(case):
    check(hf_config.spec_from_hf_config(UNUSUAL[case], name="t"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_configs())
def test_random_configs(config):
    check(hf_config.spec_from_hf_config(config, name="t"))


@pytest.mark.parametrize("case", ["bert-odd-vocab-untied-mlm", "roberta-untied-mlm", "distilbert-untied-mlm",
                                  "gpt2-n-inner-untied", "bert-cls-5"])
def test_gradient_shapes_are_the_tensors_that_get_a_grad(case):
    """One real CPU step: the tensors with a .grad, in order (untied BERT/RoBERTa MLM leave the head bias out)."""
    spec = hf_config.spec_from_hf_config(UNUSUAL[case], name="t")
    data = spec.model_dump(mode="json")
    model = modeling.build_model(data)
    modeling.loss_of(model, modeling.make_batch(data, 2, 8, "cpu")).backward()
    assert list(model_gradient_tensor_shapes(spec)) == [tuple(p.shape) for p in model.parameters() if p.grad is not None]

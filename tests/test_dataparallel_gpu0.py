"""nn.DataParallel's extra on GPU 0 (the whole batch before `scatter`, every replica's outputs after `gather`)
has one formula, `memory.parallel.dataparallel_gpu0_extra_bytes`, which both front ends call (issue 33: the
traced front end had its own copy in pipeline/step.py). The two front ends must agree on a catalog model
written out as user code, and the analytic output bytes must be the logits the activations model keeps.

The old analytic copy said fp32 logits and 8 bytes for a classifier whatever its labels; the module returns
16-bit logits under autocast (transformers' GPT2LMHeadModel, BertForSequenceClassification under CPU autocast
bf16: logits bfloat16) and num_labels of them, as the tracer records.
"""

from __future__ import annotations

import pytest

from planner.memory.parallel import dataparallel_gpu0_extra, dataparallel_output_bytes_per_sample
from planner.spec import TrainConfig
from tests import saved_tensors as st
from tests.catalog_user import catalog_user_file

INSTANCE = "ml.p4d.24xlarge"  # 8 A100s
ALLOC_BLOCK = 512  # the caching allocator's smallest block: the tracer's storages are rounded to it


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
@pytest.mark.parametrize(("family", "head"), [("gpt2", "causal-lm"), ("bert", "sequence-classification")])
def test_both_front_ends_put_the_same_extra_on_gpu0(tmp_path, family, head, precision):
    from planner.pipeline.step import _prepare, _prepare_traced

    spec = st.model(family, head)
    path = catalog_user_file(tmp_path, spec, "catalog_model.py")
    cfg = TrainConfig(batch_size=4, seq_len=64, attention="sdpa", parallelism="dp", precision=precision)
    analytic = _prepare(spec, cfg, INSTANCE, None, "cuda", None)
    traced = _prepare_traced(f"{path}:build", cfg, INSTANCE, None, "cuda", {"attention": "sdpa"},
                             f"{path}:batch", None)
    a, t = analytic.step.extra_forward_bytes, traced.step.extra_forward_bytes
    gpus = analytic.inst.gpus
    assert a > 0 and analytic.step.batch_bytes == traced.step.batch_bytes
    # the traced logits are storages rounded to the allocator's block; a classifier's few bytes show it
    assert 0 <= t - a < ALLOC_BLOCK * gpus, (a, t)
    if head == "causal-lm":
        assert t == a


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "bf16"])
@pytest.mark.parametrize(("family", "head"), [("gpt2", "causal-lm"), ("bert", "masked-lm"),
                                               ("roberta", "sequence-classification")])
def test_the_gathered_outputs_are_the_logits_the_activations_model_keeps(family, head, precision):
    from planner.memory.activations import activation_blocks

    spec = st.model(family, head)
    cfg = TrainConfig(batch_size=3, seq_len=32, attention="sdpa", parallelism="dp", precision=precision)
    retained = sum(b.retained_output_bytes for b in activation_blocks(spec, cfg))
    assert retained == cfg.batch_size * dataparallel_output_bytes_per_sample(spec, cfg) > 0
    single = cfg.model_copy(update={"parallelism": "single"})
    assert dataparallel_gpu0_extra(spec, single, 8) == 0

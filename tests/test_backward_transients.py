"""The analytic core's backward temporaries against what real PyTorch autograd allocates, op by op.

The reference is `planner.program.trace.trace_step`: the real module's forward, loss and `backward()` under
`FakeTensorMode`, every storage an ATen op allocates and frees recorded by a `TorchDispatchMode` and mapped
to CUDA (planner/program/cuda.py). A layer's backward transient there is the peak of live storages while its
backward ops run, minus saved activations, parameter gradients and the logits the loop keeps.

Checked per transformer layer (`activations.layer_backward_transient`): equal up to the loss's two scalars
(the loss value and backward's `ones_like` seed: 2 × 512 allocator bytes), which the trace counts in every
backward block and the analytic core in none. GPT-2 ties lm_head to the token embeddings: the tied weight's
gradient is made by lm_head's backward and held from then on, while the analytic core allocates it with the
embeddings block (last in backward), so there the trace is higher by exactly that gradient (V·h). That is a
difference of gradient timing, not a missing temporary, and is asserted as such.
"""

from __future__ import annotations

import pytest

from planner.memory.activations import activation_blocks
from planner.spec import BYTES_PER_DTYPE, TrainConfig
from tests import saved_tensors as st
from tests.catalog_user import catalog_user_file

LOSS_SCALARS = 2 * 512  # loss value + backward's ones_like seed, each one 512-byte allocator block
GRAD_DTYPE = {"fp32": "float32", "amp-bf16": "float32", "amp-fp16": "float32", "bf16": "bfloat16",
              "fp16": "float16"}


def _user_file(tmp_path, spec) -> str:
    return catalog_user_file(tmp_path, spec, checkpointable=False)


def _traced_and_analytic(tmp_path, family, head, precision, attention):
    from planner.program.sources import model_trace

    spec = st.model(family, head)
    path = _user_file(tmp_path, spec)
    cfg = TrainConfig(batch_size=4, seq_len=128, precision=precision, attention=attention, parallelism="single")
    traced = model_trace(f"{path}:build", cfg, options={"attention": attention}, inputs=f"{path}:batch",
                         loss=None, backend="cuda", flash_ok=True)
    analytic = activation_blocks(spec, cfg)
    return spec, traced, analytic


CASES = [(fam, head, prec, attn)
         for fam, head in (("bert", "sequence-classification"), ("distilbert", "sequence-classification"),
                           ("gpt2", "causal-lm"), ("llama", "causal-lm"))
         for prec in ("fp32", "amp-bf16", "bf16") for attn in ("eager", "sdpa")]


@pytest.mark.parametrize(("family", "head", "precision", "attention"), CASES)
def test_layer_backward_transient_equals_the_traced_autograd_peak(tmp_path, family, head, precision, attention):
    spec, traced, analytic = _traced_and_analytic(tmp_path, family, head, precision, attention)
    layers_t = [b for b in traced.blocks if b.name.rsplit(".", 1)[-1].isdigit()]
    layers_a = [a for a in analytic if a.block.split(".")[-2:-1] == ["layer"]]
    assert len(layers_t) == len(layers_a) == spec.transformers[0].num_layers
    tied = 0
    if spec.transformers[0].tie_word_embeddings and head == "causal-lm":
        t = spec.transformers[0]
        tied = t.vocab_size * t.hidden_size * BYTES_PER_DTYPE[GRAD_DTYPE[precision]]
    for t, a in zip(layers_t, layers_a, strict=True):
        assert t.backward_transient_bytes - a.backward_transient_bytes == LOSS_SCALARS + tied, (t, a)


def test_trace_does_not_count_the_kept_logits_as_a_backward_temporary(tmp_path):
    """The logits the loop holds are `retained_bytes` (activations in the timeline) for the whole backward;
    the loss block's backward temporaries are log_softmax's and nll_loss's gradients (2·n·V fp32: CUDA's
    `nll_loss_backward` and `_log_softmax_backward_data` each allocate their output), not the logits again."""
    spec, traced, analytic = _traced_and_analytic(tmp_path, "gpt2", "causal-lm", "fp32", "eager")
    t = spec.transformers[0]
    logits = 4 * 128 * t.vocab_size * 4
    assert sum(b.retained_bytes for b in traced.blocks) == logits
    loss_t = max(b.backward_transient_bytes for b in traced.blocks if b.name in ("(model)", "loss"))
    loss_a = next(a for a in analytic if a.block == "loss").backward_transient_bytes
    assert loss_a == 2 * logits
    assert loss_t - loss_a == LOSS_SCALARS


def test_tied_lm_head_gradient_appears_at_the_heads_backward(tmp_path):
    """GPT-2's lm_head shares the token table: the trace allocates a (V, h) gradient while lm_head
    back-propagates (its `mm`), long before the embeddings run backward; the analytic trace allocates the
    table's gradient with the head block, and the embeddings keep the rest."""
    from planner.memory.events import model_block_tensors

    spec, traced, analytic = _traced_and_analytic(tmp_path, "gpt2", "causal-lm", "fp32", "eager")
    t = spec.transformers[0]
    table = t.vocab_size * t.hidden_size * 4
    fwd_end = sum(op.phase == "forward" for op in traced.ops)
    first = next(e for e in traced.events if e.action == "alloc" and e.op >= fwd_end and e.nbytes == table)
    assert traced.op_blocks[first.op] == "lm_head"
    cfg = TrainConfig(batch_size=4, seq_len=128, precision="fp32", attention="eager", parallelism="single")
    tensors = model_block_tensors(spec, analytic, cfg)
    head = next(name for name in tensors if name.endswith("head"))
    emb = next(name for name in tensors if name.endswith("embeddings"))
    assert table in tensors[head].grads and table not in tensors[emb].grads
    assert sum(tensors[head].grads) + sum(tensors[emb].grads) == sum(tensors[emb].params) + sum(tensors[head].params)

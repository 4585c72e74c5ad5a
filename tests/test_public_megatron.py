"""The published model-parallel runs of results/public/megatron/ load, and each row agrees with itself: the
figures were read from an image, so the table's own redundancy (per-GPU rate × GPUs = aggregate, the MFU
column = per-GPU rate / the H100's dense BF16 peak) catches a misread digit. No planner figure is involved."""

from __future__ import annotations

import pytest

from planner.hardware import get_instance
from planner.probes.public_megatron import (
    INSTANCE,
    load_megatron_weak_scaling,
    load_nemo_automodel,
)


def test_megatron_weak_scaling_rows_agree_with_themselves():
    rows = load_megatron_weak_scaling()
    assert len(rows) == 9 and rows[0].model_size == "1.7B" and rows[-1].model_size == "462B"
    peak = get_instance(INSTANCE).gpu.peak_tflops["bf16"]
    for r in rows:
        assert r.tp * r.pp * r.dp == r.gpus
        assert r.tflops_per_gpu * r.gpus / 1000 == pytest.approx(r.aggregate_pflops, rel=2e-3)
        assert abs(r.tflops_per_gpu / peak - r.mfu) <= 0.006  # MFU printed in whole percent
        assert r.global_batch % r.dp == 0 and r.micro_batches() == r.global_batch // r.dp
        # the printed model size: 12·L·h² per layer + untied input and output embeddings
        params = 12 * r.layers * r.hidden**2 + 2 * r.vocab * r.hidden
        assert params / 1e9 == pytest.approx(float(r.model_size.rstrip("B")), rel=0.05)


def test_nemo_row_loads_and_its_rate_is_its_step():
    (row,) = load_nemo_automodel()
    assert row.global_batch * row.seq_len / row.step_s / row.gpus == pytest.approx(row.tokens_per_s_per_gpu, rel=1e-3)
    assert row.global_batch == row.micro_batch * row.grad_accum * (row.gpus // (row.tp * row.pp * row.cp))

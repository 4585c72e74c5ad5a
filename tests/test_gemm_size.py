"""Hopper's GEMM efficiency by size (planner.perf.roofline.ARCH_GEMM_SIZE): Hockney's law on top of the wave rule."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from planner.hardware import get_gpu
from planner.perf.kernels import gemm
from planner.perf.roofline import (
    ARCH_GEMM_SIZE,
    HOPPER,
    TFLOP,
    KernelTable,
    RooflineConstants,
    _time_table,
    efficiencies,
    wave_efficiency,
)

MAMF = Path(__file__).resolve().parents[1] / "results" / "public" / "gemm" / "mamf.csv"


def _table(kernels) -> KernelTable:
    rows = np.array([[k.flops, k.bytes, *k.gemm] for k in kernels], dtype=float)
    n = len(kernels)
    return KernelTable(names=tuple(k.name for k in kernels), kind=np.zeros(n, dtype=int),
                       phase=np.zeros(n, dtype=int), count=np.ones(n), launches=np.ones(n),
                       dtype=tuple(k.dtype for k in kernels), is_gemm=np.ones(n, dtype=bool),
                       is_fused_attention=np.zeros(n, dtype=bool), base=rows, per_b=np.zeros_like(rows))


def _achieved(m: int, n: int, k: int, gpu_name: str, c: RooflineConstants = RooflineConstants()) -> float:
    """Share of the bf16 dense peak a GEMM reaches in the roofline (its kernel gap excluded)."""
    gpu = get_gpu(gpu_name)
    g = gemm("g", m, n, k, "bfloat16")
    t = _time_table(_table([g]), 1, gpu, c).seconds[0]
    return g.flops / (t * gpu.peak_tflops["bf16"] * TFLOP)


def test_asymptote_is_the_sourced_h100_figure():
    """r_inf is the committed MAMF row (792.1 of 989 TFLOPS), not a fitted number."""
    row = next(r for r in csv.DictReader(MAMF.open()) if r["accelerator"] == "NVIDIA H100 SXM")
    r_inf = dict((a, r) for a, r, _ in ARCH_GEMM_SIZE)[HOPPER]
    assert r_inf == pytest.approx(float(row["mamf_tflops"]) / float(row["theory_tflops"]), abs=0.005)


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_large_gemm_reaches_the_asymptote_times_its_waves(gpu):
    """A 70B model's MLP GEMM (4096 x 28672 x 8192, 1.9 TFLOP) runs at r_inf x wave x F / (F + F_1/2)."""
    (_, r_inf, f_half), = ARCH_GEMM_SIZE
    m, n, k = 4096, 28672, 8192
    f = 2.0 * m * n * k
    g = get_gpu(gpu)
    wave = wave_efficiency(*(np.array([x], dtype=float) for x in (1, m, n, k)), g.sm_count,
                           RooflineConstants())[0]
    expected = 1.0 / (1.0 / (r_inf * wave) + f_half / (r_inf * f))
    assert _achieved(m, n, k, gpu) == pytest.approx(expected, rel=1e-9)
    assert _achieved(m, n, k, gpu) > 0.7


def test_small_gemm_pays_the_fixed_cost():
    """BERT-base's QKV GEMM (16384 x 768 x 768, 19 GFLOP) stays near the old constant 0.45; efficiency rises with
    size towards r_inf."""
    small = _achieved(16384, 768, 768, "H100")
    assert 0.35 < small < 0.55
    sizes = [_achieved(4096, n, 4096, "H100") for n in (1024, 4096, 16384, 65536)]
    assert sizes == sorted(sizes)


def test_other_architectures_keep_the_constant():
    """A100 (no row): FLOPs / (peak x gemm_efficiency x wave), as before."""
    c = RooflineConstants()
    m, n, k = 4096, 28672, 8192
    g = get_gpu("A100")
    wave = wave_efficiency(*(np.array([x], dtype=float) for x in (1, m, n, k)), g.sm_count, c)[0]
    assert _achieved(m, n, k, "A100") == pytest.approx(efficiencies(g, c)[0] * wave, rel=1e-9)


def test_without_the_row_hopper_is_the_old_constant():
    c = RooflineConstants(arch_gemm_size=())
    g = get_gpu("H100")
    m, n, k = 4096, 28672, 8192
    wave = wave_efficiency(*(np.array([x], dtype=float) for x in (1, m, n, k)), g.sm_count, c)[0]
    assert _achieved(m, n, k, "H100", c) == pytest.approx(efficiencies(g, c)[0] * wave, rel=1e-9)

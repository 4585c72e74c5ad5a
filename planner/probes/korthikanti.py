"""Korthikanti et al. 2022 (arXiv:2205.05198), as committed in results/public/korthikanti/: Table 2's
activation bytes per transformer layer and Table 3's GPT-3-style models, loaded and evaluated.

Used by benchmarks/korthikanti.py and tests/test_parallel_activations.py as an independent check of the
planner's per-rank activations (nothing is fitted to it).
"""

from __future__ import annotations

import csv
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from planner.probes.public import public_dir


class Formula(BaseModel):
    """One row of Table 2: bytes per layer = s·b·h·(const + per_t / t) + (5·a·s²·b / t if attention_per_t)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source_id: str  # results/public/sources.csv
    technique: str
    tp: bool
    sp: bool
    selective: bool
    full: bool
    const: float
    per_t: float
    attention_per_t: bool
    where: str
    quote: str

    def bytes(self, s: int, b: int, h: int, a: int, t: int = 1) -> float:
        """The paper's activation bytes of one layer (16-bit activations, 1-byte dropout masks)."""
        return s * b * h * (self.const + self.per_t / t) + (5 * a * s * s * b / t if self.attention_per_t else 0)


class PaperModel(BaseModel):
    """One row of Table 3."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source_id: str
    model: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    seq_len: int
    vocab: int
    where: str
    checked: str


def _rows(name: str, root: Path | None) -> list[dict[str, str]]:
    path = (root or public_dir()) / "korthikanti" / name
    with path.open(newline="") as f:
        return [{k: v.strip() for k, v in r.items()} for r in csv.DictReader(f)]


def load_formulas(root: Path | None = None) -> dict[str, Formula]:
    """Table 2 by technique ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")."""
    return {r["technique"]: Formula.model_validate(r) for r in _rows("formulas.csv", root)}


def load_models(root: Path | None = None) -> list[PaperModel]:
    """Table 3's models (22B, 175B, 530B, 1T)."""
    return [PaperModel.model_validate(r) for r in _rows("models.csv", root)]

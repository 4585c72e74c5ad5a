"""Megatron-LM's published weak-scaling table (results/public/megatron/), loaded as records (issue 34 item 7).

An independent check of the model-parallel speed model: benchmarks/megatron_scaling.py prints the planner's
MFU beside each row's; nothing is fitted to them. The source, the commit and what the table leaves unstated
(micro-batch, schedule, layer form) are in results/public/megatron/README.md; this module turns a row into
what the planner takes (a GPT config.json, a TrainConfig, an instance) under those stated assumptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from planner.probes.public import _read_csv, public_dir
from planner.spec import TrainConfig

SOURCE = {
    "repo": "NVIDIA/Megatron-LM",
    "path": "README.md (section 'Training Speed and Scalability', table image images/model_table.png)",
    "commit": "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4",
    "url": "https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/images/model_table.png",
}
WEAK_SCALING_FILE = "weak_scaling_h100.csv"
INSTANCE = "ml.p5.48xlarge"  # 8 H100 SXM on NVSwitch, 3,200 Gb/s: the DGX H100 nodes' GPU and network
MICRO_BATCH = 1  # ASSUMPTION: not printed (README.md of results/public/megatron/)


class MegatronScalingRow(BaseModel):
    """One row of the table, every figure as printed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(min_length=1)
    model_size: str
    heads: int = Field(ge=1)
    hidden: int = Field(ge=1)
    layers: int = Field(ge=1)
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    gpus: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    tflops_per_gpu: float = Field(gt=0)
    mfu: float = Field(gt=0, le=1)
    aggregate_pflops: float = Field(gt=0)

    def hf_config(self) -> dict[str, Any]:
        """The GPT as a config.json (GPT-2 form: LayerNorm, 4h GELU MLP; the stated ASSUMPTION)."""
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": self.hidden,
                "n_layer": self.layers, "n_head": self.heads, "vocab_size": self.vocab, "n_positions": self.seq_len,
                "tie_word_embeddings": False, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0}

    def micro_batches(self) -> int:
        """Micro-batches per pipeline per step: global batch / (micro-batch x dp)."""
        return self.global_batch // (MICRO_BATCH * self.dp)

    def train_config(self) -> TrainConfig:
        """The run as the planner takes it: Megatron's bf16 engine with the distributed optimizer, flash
        attention, the printed TP/PP, 1F1B, micro-batch 1, instances = GPUs / 8."""
        return TrainConfig(batch_size=MICRO_BATCH, seq_len=self.seq_len, precision="amp-bf16", attention="flash",
                           framework="megatron", parallelism="ddp", distributed_optimizer=True,
                           tp=self.tp, pp=self.pp, grad_accum=self.micro_batches(), instances=self.gpus // 8)


def load_megatron_weak_scaling(root: Path | None = None) -> list[MegatronScalingRow]:
    """The rows of results/public/megatron/weak_scaling_h100.csv, checked: tp x pp x dp = GPUs."""
    from planner.errors import PlannerError

    path = (root or public_dir()) / "megatron" / WEAK_SCALING_FILE
    rows = [MegatronScalingRow.model_validate({k: v for k, v in r.items() if v != ""}) for r in _read_csv(path)]
    for r in rows:
        if r.tp * r.pp * r.dp != r.gpus:
            raise PlannerError(f"{path.name} {r.id}", f"{r.tp}x{r.pp}x{r.dp}", f"a product equal to gpus {r.gpus}")
    return rows


# ---- NeMo AutoModel's dense pre-training row (results/public/megatron/nemo_automodel_h100.csv) -----------

NEMO_SOURCE = {
    "repo": "NVIDIA-NeMo/Automodel",
    "path": "docs/performance-summary.mdx (Pre-Training Performance, DGX-H100, BF16)",
    "commit": "cb9765441e5127b8100879ca1f7ff5920f825887",
    "url": "https://docs.nvidia.com/nemo/automodel/nightly/performance-summary.html",
}
NEMO_FILE = "nemo_automodel_h100.csv"
LLAMA3_70B_CONFIG = "tests/data/llama-3-70b.json"  # the same sizes as Llama-3.1-70B


class NemoRow(BaseModel):
    """One row of NeMo AutoModel's table, as printed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(min_length=1)
    model: str
    gpus: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    cp: int = Field(ge=1)
    fsdp: int = Field(ge=1)
    precision: str
    attention: str
    step_s: float = Field(gt=0)
    tflops_per_gpu: float = Field(gt=0)
    tokens_per_s_per_gpu: float = Field(gt=0)

    def train_config(self) -> TrainConfig:
        """The row as the planner takes it: FSDP over the data-parallel ranks, the printed CP and batch."""
        return TrainConfig(batch_size=self.micro_batch, seq_len=self.seq_len, precision=self.precision,
                           attention=self.attention, parallelism="fsdp", tp=self.tp, pp=self.pp, cp=self.cp,
                           grad_accum=self.grad_accum, instances=self.gpus // 8)


def load_nemo_automodel(root: Path | None = None) -> list[NemoRow]:
    """The rows of results/public/megatron/nemo_automodel_h100.csv, checked: the printed tokens/s/GPU is
    global batch x sequence / step / GPUs."""
    from planner.errors import PlannerError

    path = (root or public_dir()) / "megatron" / NEMO_FILE
    rows = [NemoRow.model_validate({k: v for k, v in r.items() if v != ""}) for r in _read_csv(path)]
    for r in rows:
        rate = r.global_batch * r.seq_len / r.step_s / r.gpus
        if abs(rate / r.tokens_per_s_per_gpu - 1) > 0.01:
            raise PlannerError(f"{path.name} {r.id}", r.tokens_per_s_per_gpu, f"about {rate:.1f} (GBS x seq / step / GPUs)")
    return rows

"""Published mixture-of-experts and FP8 training runs (results/public/moe/, results/public/fp8/), loaded as records
(issue 35 item 7).

An independent check of the MoE and FP8 models: `benchmarks/public_moe_fp8.py` prints the planner's tokens/s per
GPU, MFU, FP8-over-bf16 speed-up and (where printed) peak memory beside each row's; nothing is fitted to them.
Every row carries its own source (repository, file, commit, URL, the day it was read) and the table row it
copies (`where`); what a source leaves unstated and the benchmark assumes is said in the folder's README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.probes.public import _read_csv, public_dir
from planner.spec import TrainConfig

FILES = {"fp8": "fp8/runs.csv", "moe": "moe/runs.csv"}
GPUS_PER_INSTANCE = 8  # every row ran on 8-GPU H100 nodes (DGX H100, Grand Teton), as ml.p5.48xlarge has
INSTANCE = {"H100-80GB": "ml.p5.48xlarge"}


class PublishedRun(BaseModel):
    """One published run, every figure as printed (blank: not printed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(min_length=1)
    model: str = Field(min_length=1)  # catalog name, or a config.json of this repository (Llama-3-70B's)
    gpu: str
    gpus: int = Field(ge=1)
    framework: Literal["pytorch", "torchtitan", "megatron", "nemo-automodel"]
    parallelism: Literal["ddp", "fsdp"]
    precision: Literal["bf16", "amp-bf16", "fp8"]
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed", "current", "mxfp8"] | None = None
    fp8_param_gather: bool = False
    compile: bool = False
    recompute: Literal["none", "full", "selective"] = "none"
    # Megatron's recompute_modules under selective recomputation, space-separated (blank: the default, core_attn;
    # torchtitan's per-op policy under --framework torchtitan)
    recompute_modules: str = ""
    # Megatron-Core DDP's grad_reduce_in_fp32 as the row's recipe sets it (blank: the framework's default)
    grad_reduce_in_fp32: bool | None = None
    # FSDP's reshard_after_forward as the row's recipe sets it (NeMo AutoModel's `parallelizer.reshard_after_forward`;
    # blank: the framework's default)
    reshard_after_forward: bool | None = None
    # NeMo AutoModel's benchmark router (the recipe's `model.backend.fake_balanced_gate`): the model option
    # fake_balanced_gate=true (TransformerSpec.fake_balanced_gate)
    fake_balanced_gate: bool = False
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)  # micro-batches per step (under PP: per pipeline)
    seq_len: int = Field(ge=1)
    optimizer: Literal["adam", "adamw"]
    attention: Literal["sdpa", "flash"]
    tokens_per_s_per_gpu: float = Field(gt=0)
    tflops_per_gpu: float | None = Field(None, gt=0)
    peak_gib: float | None = Field(None, gt=0)
    peak_kind: Literal["reserved"] | None = None
    baseline: str | None = None  # the bf16 run of the same source this FP8 run is a speed-up over
    repo: str = Field(min_length=3)
    path: str = Field(min_length=1)
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    url: str = Field(pattern=r"^https://")
    read_on: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    where: str = Field(min_length=10)

    @field_validator("fp8_recipe", "tflops_per_gpu", "peak_gib", "peak_kind", "baseline", "grad_reduce_in_fp32",
                     "reshard_after_forward", mode="before")
    @classmethod
    def _blank(cls, value: object) -> object:
        return None if value == "" else value

    def model_ref(self, root: Path) -> str:
        """What `planner.estimate` takes: the catalog name, or the config.json's path under `root` (the repo)."""
        return str(root / self.model) if self.model.endswith(".json") else self.model

    def model_options(self) -> dict[str, bool]:
        """The model options of the row (`planner estimate -o ...`)."""
        return {"fake_balanced_gate": True} if self.fake_balanced_gate else {}

    @property
    def instance(self) -> str:
        return INSTANCE[self.gpu]

    def _recompute_modules(self) -> tuple[str, ...]:
        if self.recompute != "selective":
            return ()
        if self.recompute_modules:
            return tuple(self.recompute_modules.split())
        # torchtitan's selective AC is its per-op policy (planner.ir.transforms TORCHTITAN_OP)
        return ("op",) if self.framework == "torchtitan" else ()

    def train_config(self) -> TrainConfig:
        """The run as the planner takes it: the printed layout and batch, instances = GPUs / 8."""
        full = self.recompute == "full"
        return TrainConfig(
            batch_size=self.micro_batch, seq_len=self.seq_len, precision=self.precision, optimizer=self.optimizer,
            attention=self.attention, parallelism=self.parallelism, framework=self.framework,
            grad_accum=self.grad_accum, instances=max(1, self.gpus // GPUS_PER_INSTANCE), tp=self.tp, pp=self.pp,
            vp=self.vp, ep=self.ep, checkpointing=full, recompute="selective" if self.recompute == "selective" else None,
            # torchtitan's selective AC is its per-op policy (planner.ir.transforms TORCHTITAN_OP)
            recompute_modules=self._recompute_modules(),
            compile=self.compile, fp8_recipe=self.fp8_recipe, fp8_param_gather=self.fp8_param_gather,
            distributed_optimizer=self.framework == "megatron" and self.parallelism == "ddp",
            grad_reduce_in_fp32=self.grad_reduce_in_fp32, reshard_after_forward=self.reshard_after_forward)


def load_published(kind: str, root: Path | None = None) -> list[PublishedRun]:
    """The rows of results/public/<kind>/runs.csv (kind: fp8 or moe), checked: a baseline names a bf16 row of
    the same file, an FP8 row names its recipe."""
    from planner.errors import PlannerError

    path = (root or public_dir()) / FILES[kind]
    rows = [PublishedRun.model_validate(r) for r in _read_csv(path)]
    by_id = {r.id: r for r in rows}
    if len(by_id) != len(rows):
        raise PlannerError(f"{path.name} id", "a repeated id", "one row per id")
    for r in rows:
        if (r.precision == "fp8") != (r.fp8_recipe is not None):
            raise PlannerError(f"{path.name} {r.id} fp8_recipe", r.fp8_recipe, "a recipe exactly on the fp8 rows")
        base = by_id.get(r.baseline or "")
        if r.baseline and (base is None or base.precision == "fp8" or base.gpus != r.gpus):
            raise PlannerError(f"{path.name} {r.id} baseline", r.baseline, "a 16-bit row of the same file and GPUs")
    return rows

"""Published GPU training runs (`results/public/`): load, validate, and map each row to planner inputs.

Why: the memory and speed models are judged against runs this project did not tune on. Every row is a
number a public source printed (README tables, benchmark CSVs, GitHub issues), with the source in
`results/public/sources.csv` and the exact place (`where`) and text (`quote`) in the row itself. Constants
may be fitted only to rows committed here; never to the held-out sets (tlkh/transformers-benchmarking,
the Hugging Face "perf_train_gpu_one" page, DeepSpeed's BingBertSquad tables).

Files: `memory/runs.csv` (outcome `ran`/`oom`, optional measured peak), `throughput/runs.csv`
(samples/s of all GPUs of the run). Each row maps to a `TrainConfig`, catalog model options and an
`Instance` with the run's GPU (`public_instance`). I/O stays here, at the edge; the rest is pure.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner import caches
from planner.errors import PlannerError
from planner.parallel import is_default
from planner.spec import (
    ATTENTIONS,
    FRAMEWORKS,
    OPTIMIZERS,
    PARALLELISMS,
    PRECISIONS,
    Attention,
    Framework,
    Instance,
    Loop,
    OptimizerImpl,
    OptimizerName,
    Parallelism,
    Precision,
    TrainConfig,
)

PUBLIC_DIR_ENV = "PLANNER_PUBLIC_DIR"  # override where results/public/ is read from
MEMORY_FILE = "memory/runs.csv"
THROUGHPUT_FILE = "throughput/runs.csv"
SHARDED_FILE = "sharded/runs.csv"
SOURCES_FILE = "sources.csv"
MIB = 1 << 20
# A published training speed above this is a typo, not a measurement (samples/s of one run, all GPUs).
MAX_SAMPLES_PER_S = 1e6
HEADS = ("base", "sequence-classification", "masked-lm", "causal-lm")
PeakKind = Literal["nvidia-smi", "max_memory_allocated", "max_memory_reserved", "oom-message-reserved"]


def public_dir() -> Path:
    """`results/public/` of this checkout (or `$PLANNER_PUBLIC_DIR`)."""
    env = os.environ.get(PUBLIC_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "results" / "public"


class PublicSource(BaseModel):
    """One public source: where the numbers were printed and when it was read."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source_id: str = Field(min_length=1)
    kind: str = Field(min_length=1)
    url: str = Field(min_length=8)
    repo: str = ""
    path: str = ""
    commit: str = ""
    published: str = ""
    read_on: str = Field(min_length=4)
    note: str = ""


class PublicRun(BaseModel):
    """What every public row shares: the run's configuration, stack and citation."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(min_length=1)
    source_id: str = Field(min_length=1)
    model: str = Field(min_length=1)  # a catalog name (`planner models`)
    head: Literal["base", "sequence-classification", "masked-lm", "causal-lm"]
    num_labels: int | None = Field(None, ge=1)
    task: str = ""
    gpu: str = Field(min_length=1)  # a GPU id of planner/data/gpus.json ("V100-16GB")
    gpu_variant: str = ""  # the board as the source names it (SXM2/PCIe, DGX, cloud)
    gpus: int = Field(ge=1, le=64)
    parallelism: Parallelism
    batch_size: int = Field(ge=1)  # micro-batch per GPU
    seq_len: int = Field(ge=1)
    precision: Precision
    tf32: bool = False  # fp32 storage with TF32 tensor-core matmuls (Ampere+ defaults in NGC containers)
    checkpointing: bool = False
    optimizer: OptimizerName
    optimizer_impl: OptimizerImpl
    attention: Attention
    grad_accum: int = Field(1, ge=1)
    torch: str = ""
    cuda: str = ""
    transformers: str = ""
    stack_note: str = ""
    where: str = Field(min_length=3)  # table / file / line the number comes from
    quote: str = Field(min_length=3)  # the source's own text

    def train_config(self) -> TrainConfig:
        """The run as a planner TrainConfig (batch is per GPU); `tf32` only once TrainConfig has that field."""
        extra = {"tf32": self.tf32} if "tf32" in TrainConfig.model_fields else {}
        return TrainConfig(batch_size=self.batch_size, seq_len=self.seq_len, precision=self.precision,
                           optimizer=self.optimizer, optimizer_impl=self.optimizer_impl,
                           parallelism=self.parallelism, checkpointing=self.checkpointing,
                           attention=self.attention, grad_accum=self.grad_accum, **extra)

    def model_options(self) -> dict[str, Any]:
        """Catalog options giving the run's head (`-o head=... -o num_labels=...`)."""
        out: dict[str, Any] = {"head": self.head}
        if self.num_labels is not None:
            out["num_labels"] = self.num_labels
        return out

    def instance(self) -> Instance:
        """An instance with `gpus` of the run's GPU (see `public_instance`)."""
        return public_instance(self.gpu, self.gpus)

    def stack(self) -> dict[str, str]:
        """Software versions the source states (empty strings dropped)."""
        pairs = {"torch": self.torch, "cuda": self.cuda, "transformers": self.transformers}
        return {k: v for k, v in pairs.items() if v}


class MemoryRun(PublicRun):
    """A run that fit (`ran`) or hit CUDA OOM (`oom`), with its measured peak when the source gives one."""

    outcome: Literal["ran", "oom"]
    peak_mib: float | None = Field(None, gt=0)
    peak_kind: PeakKind | None = None


class ThroughputRun(PublicRun):
    """A published training speed: samples (sequences) per second of all `gpus` together."""

    samples_per_s: float = Field(gt=0, lt=MAX_SAMPLES_PER_S)
    unit: Literal["sequences/s", "samples/s"] = "sequences/s"
    # "fixed": every batch had seq_len tokens per sample. "max": batches were padded only to their longest
    # sample (binned or dynamic padding), so they ran at up to seq_len; a prediction at seq_len is then a
    # floor on the published speed, not a point to compare with.
    seq_len_kind: Literal["fixed", "max"] = "fixed"

    @property
    def fixed_length(self) -> bool:
        """Whether the published speed is that of `seq_len`-token samples (comparable with a prediction)."""
        return self.seq_len_kind == "fixed"

    @property
    def samples_per_s_per_gpu(self) -> float:
        return self.samples_per_s / self.gpus


class ShardedRun(MemoryRun):
    """A published FSDP / ZeRO run (`sharded/runs.csv`): a memory row plus whose framework ran it and its LoRA
    adapters, if any. `seq_len_kind` "max": samples were padded to their longest, so `seq_len` is an upper
    bound (a fit predicted there holds at any shorter length; an OOM predicted there may not)."""

    framework: Framework = "pytorch"
    seq_len_kind: Literal["fixed", "max"] = "fixed"
    lora_r: int | None = Field(None, ge=1)
    lora_alpha: float | None = None
    lora_targets: str = ""  # "q_proj,v_proj"
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    # the training loop's tensor lifetimes (`--loop`): "loss-only" where the script keeps only the loss
    # (`loss = model(**batch).loss`), "plain" where it keeps the outputs until the step ends
    loop: Loop = "plain"
    # the model's training forward returns its KV cache (model option `use_cache`, planner/memory/kv_cache.py):
    # the config's use_cache left on and checkpointing that transformers does not see (FSDP's wrapper)
    use_cache: bool = False
    # the job's DeepSpeed config, a file under sharded/ (`--ds-config`): its stage, buckets, and whether the
    # script's own optimizer steps the partitions (no "optimizer" block)
    ds_config: str = ""

    def model_options(self) -> dict[str, Any]:
        return super().model_options() | ({"use_cache": True} if self.use_cache else {})

    def train_config(self) -> TrainConfig:
        base = super().train_config()
        extra: dict[str, Any] = {"framework": self.framework, "loop": self.loop}
        if self.ds_config:
            from planner.parallel.ds_config import read_ds_config

            extra["deepspeed"] = read_ds_config(str(public_dir() / "sharded" / self.ds_config))
        if self.lora_r is not None:
            extra |= {"lora_r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                      "lora_targets": tuple(t for t in self.lora_targets.split(",") if t)}
        return base.model_copy(update=extra)


class ShardedSpeedRun(BaseModel):
    """A published FSDP / ZeRO-3 training speed (`sharded/speed.csv`): tokens per second per GPU of a model
    given as a config.json under `sharded/` (`model_config`, its parameter count `params` as the source
    prints it), on `gpus` GPUs of nodes of 8 linked at `network_gbps` (the run's own interconnect)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(min_length=1)
    source_id: str = Field(min_length=1)
    model_config_file: str = Field(min_length=1, alias="model_config")
    params: int = Field(gt=0)
    gpu: str = Field(min_length=1)
    gpus: int = Field(ge=1, le=1024)
    network_gbps: float = Field(gt=0)
    parallelism: Parallelism
    framework: Framework = "pytorch"
    batch_size: int = Field(ge=1)
    grad_accum: int = Field(1, ge=1)
    seq_len: int = Field(ge=1)
    precision: Precision
    checkpointing: bool = False
    attention: Attention
    tokens_per_s_per_gpu: float = Field(gt=0)
    stack_note: str = ""
    where: str = Field(min_length=3)
    quote: str = Field(min_length=3)

    def config_path(self, root: Path | None = None) -> Path:
        return (root or public_dir()) / "sharded" / self.model_config_file

    def train_config(self, gpus_per_node: int) -> TrainConfig:
        return TrainConfig(batch_size=self.batch_size, grad_accum=self.grad_accum, seq_len=self.seq_len,
                           precision=self.precision, checkpointing=self.checkpointing, attention=self.attention,
                           parallelism=self.parallelism, framework=self.framework,
                           instances=max(self.gpus // gpus_per_node, 1))

    def instance(self) -> Instance:
        """A node of this GPU (all of its GPUs, or `gpus` when fewer) with the run's network between nodes."""
        from planner.hardware import get_gpu, instance_table

        wanted = get_gpu(self.gpu)
        node = max((n for n, rec in instance_table().items() if get_gpu(rec["gpu"]).name == wanted.name),
                   key=lambda n: (instance_table()[n]["gpus"], n))
        base = public_instance(self.gpu, min(self.gpus, instance_table()[node]["gpus"]))
        return base.model_copy(update={"network_gbps": self.network_gbps})


# ---- the GPU a row ran on --------------------------------------------------------------------------


def public_instance(gpu: str, gpus: int) -> Instance:
    """The SageMaker instance with exactly `gpus` of this GPU (e.g. V100-16GB x8 -> ml.p3.16xlarge).

    Public runs also use counts no SageMaker type has (one V100-32GB, one A100): then the smallest
    instance type with that GPU is re-counted to `gpus`, its price scaled per GPU. ASSUMPTION: for a
    re-counted multi-GPU run the instance's interconnect stands in for the run's (NVLink in DGX boxes).
    """
    from planner.hardware import get_gpu, get_instance, instance_table

    wanted = get_gpu(gpu)
    table = instance_table()
    same = [name for name, rec in table.items() if get_gpu(rec["gpu"]).name == wanted.name]
    if not same:
        raise PlannerError("gpu", gpu, "a GPU of a SageMaker instance type (`planner instances`)")
    exact = [n for n in same if table[n]["gpus"] == gpus]
    if exact:
        return get_instance(exact[0])
    base = get_instance(min(same, key=lambda n: (table[n]["gpus"], n)))
    price = base.price_per_hour * gpus / base.gpus if base.price_per_hour is not None else None
    return base.model_copy(update={"gpus": gpus, "name": f"{base.name} as {gpus}x {gpu}", "price_per_hour": price})


# ---- loading ---------------------------------------------------------------------------------------


def _read_csv(path: Path) -> list[dict[str, str]]:
    import pandas as pd

    if not path.is_file():
        raise PlannerError("public data", str(path), "an existing CSV under results/public/")
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    return frame.to_dict(orient="records")


def _clean(record: dict[str, str]) -> dict[str, Any]:
    """CSV strings to model fields: blanks become None (so defaults apply), booleans parse."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        value = value.strip()
        if value == "":
            continue
        if value.lower() in ("true", "false") and key in ("tf32", "checkpointing"):
            out[key] = value.lower() == "true"
        else:
            out[key] = value
    return out


def _parse(kind: type[PublicRun], path: Path) -> list[Any]:
    rows = []
    for number, record in enumerate(_read_csv(path), start=2):  # line 1 is the header
        try:
            rows.append(kind.model_validate(_clean(record)))
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "row"
            raise PlannerError(f"{path.name} line {number} {field}", first.get("input"), first["msg"]) from None
    return rows


@caches.lru(None, scope="facts", key="the public-data root")
def _sources(root: str) -> dict[str, PublicSource]:
    path = Path(root) / SOURCES_FILE
    out = {}
    for number, record in enumerate(_read_csv(path), start=2):
        try:
            src = PublicSource.model_validate({k: v.strip() for k, v in record.items()})
        except ValidationError as err:
            first = err.errors()[0]
            raise PlannerError(f"{path.name} line {number} {first['loc'][0]}", first.get("input"),
                               first["msg"]) from None
        out[src.source_id] = src
    return out


def load_public_sources(root: Path | None = None) -> dict[str, PublicSource]:
    """`sources.csv` by source id."""
    return dict(_sources(str(root or public_dir())))


def _check(rows: list[PublicRun], root: Path, name: str) -> None:
    """What pydantic cannot see: known source, model, GPU; unique ids; allowed literals named."""
    from planner.hardware import get_gpu
    from planner.models.catalog import list_models

    sources = load_public_sources(root)
    models = set(list_models())
    seen: set[str] = set()
    for row in rows:
        where = f"{name} row {row.id}"
        if row.id in seen:
            raise PlannerError(f"{where} id", row.id, "unique ids")
        seen.add(row.id)
        if row.source_id not in sources:
            raise PlannerError(f"{where} source_id", row.source_id, sorted(sources))
        if row.model not in models:
            raise PlannerError(f"{where} model", row.model, "a catalog name (`planner models`)")
        get_gpu(row.gpu)  # raises with near names
        if row.gpus == 1 and not is_default(row.parallelism):
            raise PlannerError(f"{where} parallelism", row.parallelism, "single for a one-GPU run")
        assert row.precision in PRECISIONS and row.attention in ATTENTIONS and row.optimizer in OPTIMIZERS
        assert row.parallelism in PARALLELISMS or row.parallelism == "auto"


def load_public_memory(root: Path | None = None) -> list[MemoryRun]:
    """Validated rows of `results/public/memory/runs.csv`."""
    base = root or public_dir()
    rows = _parse(MemoryRun, base / MEMORY_FILE)
    _check(rows, base, MEMORY_FILE)
    _check_peaks(rows, MEMORY_FILE)
    return rows


def _check_peaks(rows: list[MemoryRun] | list[ShardedRun], file: str) -> None:
    """A measured peak comes with its kind (and only then) and is a finite number of MiB."""
    for row in rows:
        if (row.peak_mib is None) != (row.peak_kind is None):
            raise PlannerError(f"{file} row {row.id} peak_kind", row.peak_kind,
                               "given together with peak_mib, and only then")
        if row.peak_mib is not None and not math.isfinite(row.peak_mib):
            raise PlannerError(f"{file} row {row.id} peak_mib", row.peak_mib, "a finite number of MiB")


def load_public_sharded(root: Path | None = None) -> list[ShardedRun]:
    """Validated rows of `results/public/sharded/runs.csv` (FSDP / ZeRO runs, LoRA ones included)."""
    base = root or public_dir()
    rows = _parse(ShardedRun, base / SHARDED_FILE)
    _check(rows, base, SHARDED_FILE)
    _check_peaks(rows, SHARDED_FILE)
    for row in rows:
        assert row.framework in FRAMEWORKS
    return rows


SHARDED_SPEED_FILE = "sharded/speed.csv"


def load_public_sharded_speed(root: Path | None = None) -> list[ShardedSpeedRun]:
    """Validated rows of `results/public/sharded/speed.csv` (published FSDP / ZeRO-3 speeds)."""
    from planner.hardware import get_gpu

    base = root or public_dir()
    rows = _parse(ShardedSpeedRun, base / SHARDED_SPEED_FILE)
    sources = load_public_sources(base)
    seen: set[str] = set()
    for row in rows:
        where = f"{SHARDED_SPEED_FILE} row {row.id}"
        if row.id in seen:
            raise PlannerError(f"{where} id", row.id, "unique ids")
        seen.add(row.id)
        if row.source_id not in sources:
            raise PlannerError(f"{where} source_id", row.source_id, sorted(sources))
        if not row.config_path(base).is_file():
            raise PlannerError(f"{where} model_config", row.model_config_file, "a config.json under sharded/")
        get_gpu(row.gpu)
    return rows


def load_public_throughput(root: Path | None = None) -> list[ThroughputRun]:
    """Validated rows of `results/public/throughput/runs.csv`."""
    base = root or public_dir()
    rows = _parse(ThroughputRun, base / THROUGHPUT_FILE)
    _check(rows, base, THROUGHPUT_FILE)
    return rows


# The sources the speed model's constants are fitted on (benchmarks/fit_roofline.py: the three efficiencies;
# benchmarks/fit_scaling.py: rank_speed_spread); every other source is held out.
SPEED_FIT_SOURCES = ("dle-bert-1907", "dle-bert-2006")


def single_gpu_fixed(rows: list[ThroughputRun]) -> list[ThroughputRun]:
    """The one-GPU rows at a fixed sequence length: what a prediction's error is measured on (a `max` row's
    prediction is only a floor)."""
    return [r for r in rows if r.gpus == 1 and r.fixed_length]


def scaling_pairs(rows: list[ThroughputRun]) -> list[tuple[ThroughputRun, ThroughputRun]]:
    """(multi-GPU row, its one-GPU twin): same source, task, model, GPU, sequence, precision, TF32, micro-batch
    and accumulation, fixed length. Their ratio is the run's scaling, free of the one-GPU speed error."""
    def key(r: ThroughputRun) -> tuple:
        return (r.source_id, r.task, r.model, r.head, r.gpu, r.seq_len, r.precision, r.tf32, r.batch_size,
                r.grad_accum, r.checkpointing)

    single = {key(r): r for r in single_gpu_fixed(rows)}
    return [(r, single[key(r)]) for r in rows if r.gpus > 1 and r.fixed_length and key(r) in single]


def scaling_errors(pairs: list[tuple[ThroughputRun, ThroughputRun]], constants: Any = None) -> list[float]:
    """log(predicted scaling / published scaling) of each `scaling_pairs` pair, from planner.perf.throughput
    (`constants`: its ThroughputConstants, default when None)."""
    from planner.models.catalog import cached_model
    from planner.perf.throughput import predict_throughput
    from planner.pipeline.resolve import resolve_parallelism

    def speed(row: ThroughputRun) -> float:
        config = resolve_parallelism(row.train_config(), row.instance())  # a published row may say "auto"
        return predict_throughput(model, config, row.instance(), constants).samples_per_s

    out = []
    for multi, single in pairs:
        model = cached_model(multi.model, multi.model_options())
        pm, ps = speed(multi), speed(single)
        out.append(math.log((pm / ps) / (multi.samples_per_s / single.samples_per_s)))
    return out


def rows_frame(rows: list[PublicRun]):
    """The rows as a pandas DataFrame (one column per field), for the benchmark scripts."""
    import pandas as pd

    return pd.DataFrame([r.model_dump() for r in rows])

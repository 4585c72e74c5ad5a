"""GPUs and SageMaker training instances, loaded from `planner/data/gpus.json` and `instances.json`.

The data files carry a source for every figure (datasheet, AWS page, nccl-tests issue) and a date for
every price; this module only turns them into the frozen `GPU` / `Instance` models and looks them up.
Memory: `GPU.memory_bytes` is the nominal (marketed) size read as GiB, e.g. a "16 GB" V100 = 16 GiB;
`GPU.reported_memory_bytes` is what the driver typically reports as total (nvidia-smi), a little less.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from planner import caches
from planner.errors import unknown
from planner.spec import GPU, Instance

GIB = 1 << 30
MIB = 1 << 20
INSTANCE_PREFIX = "ml."


@caches.lru(None, scope="facts", key="the data file's name")
def _load(name: str) -> dict[str, Any]:
    """One packaged JSON file, parsed once per process."""
    try:
        text = resources.files("planner").joinpath("data", name).read_text(encoding="utf-8")
    except (NotADirectoryError, ModuleNotFoundError, TypeError):  # namespace-package edge cases of editable installs
        text = (Path(__file__).parent / "data" / name).read_text(encoding="utf-8")
    return json.loads(text)


def gpu_table() -> dict[str, dict[str, Any]]:
    """Raw GPU records keyed by id ("V100-16GB", ...), as in the data file."""
    return _load("gpus.json")["gpus"]


def instance_table() -> dict[str, dict[str, Any]]:
    """Raw instance records keyed by SageMaker name, with the extra fields (network text, EFA, sources)."""
    return _load("instances.json")["instances"]


def _with_assumed(record: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The record with each unpublished (null) figure taken from its "assumed" entry, and one line per
    figure so taken. gpus.json keeps the published figure null (never invented); the value an estimate
    needs lives beside it under "assumed" ({"peak_tflops.bf16": {"value": 500, "why": "..."}}), so every
    estimate on this GPU can say which value it assumed."""
    assumed = record.get("assumed") or {}
    out = dict(record)
    out["peak_tflops"] = dict(record.get("peak_tflops") or {})
    lines: list[str] = []
    for path, entry in assumed.items():
        head, _, key = path.partition(".")
        holder = out[head] if key else out
        name = key or head
        if holder.get(name) is None:
            holder[name] = entry["value"]
            lines.append(f"{record['name']}: {path} = {entry['value']} assumed ({entry['why']})")
    out["peak_tflops"] = {k: v for k, v in out["peak_tflops"].items() if v is not None}
    return out, tuple(lines)


def _gpu_from_record(record: dict[str, Any]) -> GPU:
    record, assumptions = _with_assumed(record)
    reported = record.get("reported_memory_mib")
    runtime = record.get("runtime") or {}
    return GPU(
        name=record["name"],
        family=record["family"],
        memory_bytes=int(record["memory_gib"] * GIB),
        compute_capability=tuple(record["compute_capability"]),
        peak_tflops=dict(record["peak_tflops"]),
        memory_bandwidth_gbs=float(record["memory_bandwidth_gbs"]),
        bf16=record["bf16"],
        flash_attention=record["flash_attention"],
        sources=tuple(record["sources"]),
        reported_memory_bytes=int(reported * MIB) if reported else None,
        sm_count=record.get("sm_count"),
        boost_clock_mhz=record.get("boost_clock_mhz"),
        l2_mib=record.get("l2_mib"),
        nvlink_gbs=record.get("nvlink_gbs") or 0.0,
        pcie_gbs=record.get("pcie_gbs"),
        cuda_context_mib=runtime.get("cuda_context_mib"),
        nccl_channels=runtime.get("nccl_channels"),
        runtime_source=runtime.get("source", ""),
        assumptions=assumptions,
    )


@caches.lru(None, scope="facts", key="none: gpus.json")
def _gpus() -> dict[str, GPU]:
    return {key: _gpu_from_record(rec) for key, rec in gpu_table().items()}


def _instance_with_assumed(name: str, rec: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The row with each null figure it has an "assumed" value for filled in, and one line per figure."""
    out = dict(rec)
    lines = []
    for key, entry in (rec.get("assumed") or {}).items():
        if out.get(key) is None:
            out[key] = entry["value"]
            lines.append(f"{name}: {key} = {entry['value']} assumed ({entry['why']})")
    return out, tuple(lines)


@caches.lru(None, scope="facts", key="none: instances.json")
def _instances() -> dict[str, Instance]:
    gpus = _gpus()
    fields = set(Instance.model_fields) - {"name", "gpu", "assumptions"}
    out: dict[str, Instance] = {}
    for name, raw in instance_table().items():
        rec, assumed = _instance_with_assumed(name, raw)
        out[name] = Instance(name=name, gpu=gpus[rec["gpu"]], assumptions=assumed,
                             **{k: v for k, v in rec.items() if k in fields})
    return out


def unsupported_instances() -> dict[str, dict[str, Any]]:
    """SageMaker GPU training types the planner does not model, each with its GPU and the reason."""
    return _load("instances.json").get("unsupported", {})


def list_instances(gpu: str | None = None) -> list[str]:
    """Instance names, optionally only those whose GPU family or id matches `gpu` (case-insensitive)."""
    names = list(_instances())
    if gpu is None:
        return names
    want = gpu.lower()
    ids = {name: rec["gpu"].lower() for name, rec in instance_table().items()}
    return [n for n in names if _instances()[n].gpu.family.lower() == want or ids[n] == want]


def normalize_instance_name(name: str) -> str:
    """'P3.16XLarge' -> 'ml.p3.16xlarge'; the 'ml.' prefix is optional."""
    key = name.strip().lower()
    return key if key.startswith(INSTANCE_PREFIX) else INSTANCE_PREFIX + key


def get_instance(name: str) -> Instance:
    """An instance by SageMaker name (case-insensitive, 'ml.' optional); unknown -> PlannerError with near names."""
    table = _instances()
    key = normalize_instance_name(name)
    if key not in table:
        gone = unsupported_instances().get(key)
        if gone is not None:
            from planner.errors import PlannerError

            raise PlannerError("--instance", name, f"a supported instance type; {key} is not: {gone['reason']}")
        raise unknown("--instance", name, list(table))
    return table[key]


def list_gpus() -> list[str]:
    """GPU ids ("V100-16GB", "A100-80GB", ...)."""
    return list(_gpus())


def get_gpu(family: str) -> GPU:
    """A GPU by id ("A100-80GB") or family ("A100" -> the first listed, the smaller memory); case-insensitive."""
    gpus = _gpus()
    want = family.strip().lower()
    for key, gpu in gpus.items():
        if key.lower() == want or gpu.name.lower() == want:
            return gpu
    for gpu in gpus.values():
        if gpu.family.lower() == want:
            return gpu
    raise unknown("--gpu", family, list(gpus) + sorted({g.family for g in gpus.values()}))


def gpu_families() -> list[str]:
    """Families in data order, each once (the keys of runtime and throughput constants)."""
    return list(dict.fromkeys(g.family for g in _gpus().values()))

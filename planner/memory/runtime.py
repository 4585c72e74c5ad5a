"""GPU memory that is not a PyTorch tensor of the model: CUDA context, cuBLAS workspaces, NCCL buffers,
and the caching allocator's fragmentation. One documented default per GPU family, overridable, calibratable.

Precedence (lowest to highest): the defaults below < `results/calibration.json` (written by
`planner calibrate` from probe readings) < explicit `overrides`.

Calibration file format (per family, any subset of the RuntimeConstants fields)::

    {"families": {"V100": {"cuda_context_bytes": 436207616, "fragmentation": 0.07}}, "date": "...", "source": "..."}
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.spec import GPU, RuntimeConstants

MiB = 1 << 20
KiB = 1 << 10

# ---- CUDA context --------------------------------------------------------------------------------
# Driver + CUDA runtime + the kernel images loaded lazily (CUDA_MODULE_LOADING=LAZY, PyTorch's default since
# 1.13) + per-SM local-memory reservations; outside the caching allocator, so torch.cuda.memory_reserved()
# never shows it but nvidia-smi does. Sources: PyTorch PR #86509 (context of 287,047,680 B with lazy loading vs
# 666,632,192 B eager, measured with cudaMemGetInfo after one small tensor); ptrblck in pytorch/pytorch #107667
# ("~300MB", CUDA >= 11.7 lazy loading) and #109888 ("around 400MB"). A training step loads more kernels than
# one tensor op (cuBLAS/cuBLASLt GEMMs, cuDNN, fused optimizer, NCCL), and the per-SM reservation grows with
# the SM count (V100 80, T4 40, A100 108, H100 132), hence the larger figures on newer/bigger parts.
# ASSUMPTION: the per-GPU figures are estimates to be replaced by `planner calibrate`. They are data: each row of
# planner/data/gpus.json carries "runtime": {"cuda_context_mib", "nccl_channels", "source"} (GPU.cuda_context_mib);
# a GPU without them gets the defaults below.
CUDA_CONTEXT_DEFAULT_MIB = 500

# ---- cuBLAS workspaces ---------------------------------------------------------------------------
# PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): default CUBLAS_WORKSPACE_CONFIG
# is ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB = 8,519,680 B, except sm90 (Hopper, major 9 minor 0) where it is
# 4096 x 8 KiB = 32 MiB. getCUDABlasLtWorkspaceSize(): the cuBLASLt workspace defaults to 1024 KiB and is a
# separate allocation unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1. Both come from the caching allocator (they
# count in memory_allocated) and are kept per (handle, stream): one set for the thread that runs forward, one
# for the autograd engine's device thread that runs backward (it reserves its own cuBLAS handle from the pool).
CUBLAS_WORKSPACE_DEFAULT_BYTES = 2 * 4096 * KiB + 8 * 16 * KiB  # ":4096:2:16:8"
CUBLAS_WORKSPACE_SM90_BYTES = 8 * 4096 * KiB  # 32 MiB on Hopper
CUBLASLT_WORKSPACE_BYTES = 1024 * KiB
CUBLAS_HANDLES_PER_TRAINING_PROCESS = 2  # forward thread + autograd device thread


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """cuBLAS + cuBLASLt workspaces of one training process: handles x (cuBLAS default + cuBLASLt 1 MiB)."""
    cublas = CUBLAS_WORKSPACE_SM90_BYTES if tuple(compute_capability) == (9, 0) else CUBLAS_WORKSPACE_DEFAULT_BYTES
    return CUBLAS_HANDLES_PER_TRAINING_PROCESS * (cublas + CUBLASLT_WORKSPACE_BYTES)


# ---- NCCL ----------------------------------------------------------------------------------------
# Each NCCL channel keeps, per connected peer, FIFO buffers for its three protocols: Simple = NCCL_BUFFSIZE
# (4 MiB default, NVIDIA/nccl #391), LL128 (~4.6 MiB) and LL (~0.25 MiB): ~9-10 MiB per channel per peer
# (NVIDIA/nccl #1685 shows 10,485,760 B buffers per channel connection). Memory grows linearly with the number
# of channels (S. Jeaugey, NVIDIA/nccl #864/#986: more channels to reach NVLink bandwidth, few on PCIe).
# A ring connects each rank to 2 peers (previous, next); see nccl_bytes().
NCCL_BYTES_PER_CHANNEL_PEER = 10 * MiB
# ASSUMPTION: the channel count NCCL picks for a ring all-reduce on the GPU's topology, per GPU row of
# planner/data/gpus.json ("runtime": {"nccl_channels"}: 2 on T4, 4 on PCIe parts, 8 on V100, 16 on NVSwitch parts);
# this default for a row without one.
NCCL_CHANNELS_DEFAULT = 8
NCCL_RING_PEERS = 2

# ---- fragmentation -------------------------------------------------------------------------------
# reserved/allocated - 1 at the peak. The caching allocator rounds blocks (512 B, 2 MiB segments for large
# blocks) and cannot reuse a split segment for a larger request. ZeRO (Rajbhandari et al. 2020, sec. 3.2)
# reports OOM with >30% of memory nominally free in extreme cases; typical steady training sits near 5-15%.
# ASSUMPTION: 0.10 for every family until `planner calibrate` measures it.
FRAGMENTATION: dict[str, float] = {}
FRAGMENTATION_DEFAULT = 0.10

FIELDS = ("cuda_context_bytes", "cublas_workspace_bytes", "nccl_bytes_per_peer", "fragmentation")
# What a calibration file or an override may hold; beyond this it is a typo or a unit error, not a GPU.
# ASSUMPTION: no runtime term exceeds the largest GPU's memory (B300, 288 GB < 2^38 B); reserved memory is at
# most 10x allocated (fragmentation <= 9; ZeRO sec. 3.2 reports >30% wasted in extreme cases, i.e. ~0.5).
MAX_RUNTIME_BYTES = 1 << 38
MAX_FRAGMENTATION = 9.0
BOUNDS: dict[str, tuple[float, float, bool]] = {  # field: (low, high, integer)
    "cuda_context_bytes": (0, MAX_RUNTIME_BYTES, True),
    "cublas_workspace_bytes": (0, MAX_RUNTIME_BYTES, True),
    "nccl_bytes_per_peer": (0, MAX_RUNTIME_BYTES, True),
    "fragmentation": (0.0, MAX_FRAGMENTATION, False),
}
CALIBRATION_ENV = "PLANNER_CALIBRATION"
DEFAULT_CALIBRATION_PATH = Path("results") / "calibration.json"


def default_runtime(gpu: GPU) -> dict[str, Any]:
    """The documented defaults for this GPU (its gpus.json "runtime" row), as a dict of RuntimeConstants fields."""
    fam = gpu.family
    context_mib = gpu.cuda_context_mib if gpu.cuda_context_mib is not None else CUDA_CONTEXT_DEFAULT_MIB
    channels = gpu.nccl_channels if gpu.nccl_channels is not None else NCCL_CHANNELS_DEFAULT
    return {
        "cuda_context_bytes": context_mib * MiB,
        "cublas_workspace_bytes": cublas_workspace_bytes(gpu.compute_capability),
        "nccl_bytes_per_peer": channels * NCCL_BYTES_PER_CHANNEL_PEER,
        "fragmentation": FRAGMENTATION.get(fam, FRAGMENTATION_DEFAULT),
        "source": f"the planner's defaults for {fam}",
    }


def calibration_entry(calibration: Mapping[str, Any] | None, family: str) -> dict[str, Any]:
    """Everything calibrated for one family (pure): {"families": {fam: {...}}} or {fam: {...}}."""
    if not calibration:
        return {}
    families = calibration.get("families", calibration)
    entry = families.get(family) if isinstance(families, Mapping) else None
    return {k: v for k, v in entry.items() if v is not None} if isinstance(entry, Mapping) else {}


def calibrated_values(calibration: Mapping[str, Any] | None, family: str) -> dict[str, Any]:
    """The calibrated RuntimeConstants fields for one family."""
    return {k: v for k, v in calibration_entry(calibration, family).items() if k in FIELDS}


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    bad = [k for k in overrides if k not in FIELDS]
    if bad:
        raise PlannerError("runtime override", bad[0], FIELDS)
    check_values(overrides, "runtime override")


def check_values(values: Mapping[str, Any], where: str) -> None:
    """Each RuntimeConstants field finite and in BOUNDS; `where` names the file or flag in the error."""
    from planner.io import number

    for key, value in values.items():
        if key in BOUNDS:
            low, high, integer = BOUNDS[key]
            number(value, f"{where}: {key}", low=low, high=high, integer=integer and not isinstance(value, float))


def check_calibration(calibration: Mapping[str, Any] | None = None) -> None:
    """Every family of the calibration file checked at once, so a search fails before its first trial
    rather than recording each trial as infeasible for the same bad file."""
    if calibration is None:
        calibration = load_calibration()
    families = calibration.get("families", {}) if calibration else {}
    for family in families if isinstance(families, Mapping) else ():
        check_values(calibrated_values(calibration, family), f"calibration {calibration_path()} families.{family}")


def runtime_constants(gpu: GPU, overrides: Mapping[str, Any] | None = None,
                      calibration: Mapping[str, Any] | None = None) -> RuntimeConstants:
    """Defaults for `gpu.family`, then calibration, then `overrides` (keys = RuntimeConstants field names).

    `calibration` None reads `results/calibration.json` (or $PLANNER_CALIBRATION) when it exists; pass {} to
    ignore any file.
    """
    values = default_runtime(gpu)
    if calibration is None:
        calibration = load_calibration()
    cal = calibrated_values(calibration, gpu.family)
    if cal:
        check_values(cal, f"calibration {calibration_path()} families.{gpu.family}")
        values.update(cal)
        values["source"] += f"; calibrated: {', '.join(sorted(cal))} ({calibration.get('source', 'calibration')})"
    if overrides:
        _check_overrides(overrides)
        values.update(overrides)
        values["source"] += f"{OVERRIDDEN}{', '.join(sorted(overrides))}"
    values["cuda_context_bytes"] = int(values["cuda_context_bytes"])
    values["cublas_workspace_bytes"] = int(values["cublas_workspace_bytes"])
    values["nccl_bytes_per_peer"] = int(values["nccl_bytes_per_peer"])
    return RuntimeConstants(**values)


OVERRIDDEN = "; overridden: "  # how runtime_constants marks the fields a caller set, in `source`


def overridden_fields(constants: RuntimeConstants) -> dict[str, Any]:
    """The fields of `constants` a caller overrode (--cuda-context-mib, --fragmentation), with their values, read
    back from the mark `runtime_constants` leaves in `source`: what another configuration's estimate needs to
    get the same answer `estimate` gives it with the same flags."""
    _, mark, names = constants.source.rpartition(OVERRIDDEN)
    if not mark:
        return {}
    return {name: getattr(constants, name) for name in names.split(";")[0].split(", ") if name in FIELDS}


def nccl_bytes(constants: RuntimeConstants, world_size: int) -> int:
    """NCCL buffers on one GPU: none alone, one peer at world size 2, a ring's two peers beyond."""
    if world_size <= 1:
        return 0
    return constants.nccl_bytes_per_peer * min(world_size - 1, NCCL_RING_PEERS)


def nccl_group_bytes(constants: RuntimeConstants, group_sizes: tuple[int, ...]) -> int:
    """NCCL buffers of a rank in several process groups (tensor, context, pipeline, data parallel): each group
    is its own communicator with its own channel buffers (NCCL allocates them per communicator and peer:
    NCCL_BUFFSIZE "per channel, per peer"; Megatron-Core and torchtitan's DeviceMesh create one communicator
    per group). ASSUMPTION: each group's buffers as `nccl_bytes` gives for its size (a pipeline group: the two
    neighbours at most)."""
    return sum(nccl_bytes(constants, n) for n in group_sizes)


# ---- I/O edge ------------------------------------------------------------------------------------


def calibration_path() -> Path:
    return Path(_calibration_location())


def _calibration_location() -> str | Path:
    """`calibration_path` without making a Path (every estimate looks for the file)."""
    return os.environ.get(CALIBRATION_ENV, DEFAULT_CALIBRATION_PATH)


def load_calibration(path: str | Path | None = None) -> dict[str, Any]:
    """The calibration JSON, or {} when the file does not exist (a missing file is the normal case). Read and
    checked once per file version (its mtime and size): a search estimates thousands of configurations. The
    dict is shared: callers copy what they change."""
    from planner.io import file_version

    version = file_version(path if path is not None else _calibration_location())
    return _read_calibration(*version) if version is not None else _NO_CALIBRATION


_NO_CALIBRATION: dict[str, Any] = {}  # shared like a file's dict (callers copy what they change)


@caches.lru(8, scope="facts", key="(path, mtime, size) of the calibration file")
def _read_calibration(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    from planner.io import read_json

    data = read_json(Path(path), f"calibration file (${CALIBRATION_ENV} or {DEFAULT_CALIBRATION_PATH})")
    families = data.get("families", {})
    if not isinstance(families, dict) or not all(isinstance(v, dict) for v in families.values()):
        raise PlannerError(f"{path}: families", families, 'an object {"V100": {"fragmentation": 0.07, ...}, ...}')
    for family, entry in families.items():
        _check_calibration_entry(entry, f"calibration file {path}: families.{family}")
    return data


# Fields `planner calibrate` writes besides the RuntimeConstants ones (planner.probes.calibrate.fit), and what
# each may hold: every one is read somewhere, so a word where a number belongs is an error naming the file.
MAX_THROUGHPUT_SCALE = 100.0  # measured/predicted speed; far outside anything a probe can show


def _check_calibration_entry(entry: Mapping[str, Any], where: str) -> None:
    """One family of the calibration file, every field checked once when the file is read."""
    from planner.io import number

    check_values({k: v for k, v in entry.items() if k in FIELDS and v is not None}, where)
    if entry.get("throughput_scale") is not None:
        number(entry["throughput_scale"], f"{where}.throughput_scale", low=0, high=MAX_THROUGHPUT_SCALE,
               low_open=True)
    if entry.get("module_loading") not in (None, "lazy", "eager"):
        raise PlannerError(f"{where}.module_loading", entry["module_loading"], "lazy, eager or null")
    for key in ("context_range", "fragmentation_range"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in value)):
            raise PlannerError(f"{where}.{key}", value, "[min, max], two finite numbers >= 0, or null")
    for key in ("n", "n_context", "n_throughput"):
        if entry.get(key) is not None:
            number(entry[key], f"{where}.{key}", low=0, high=2**53, integer=True)


def overrides_from_flags(cuda_context_mib: float | None = None, fragmentation: float | None = None,
                         ) -> dict[str, Any] | None:
    """The runtime overrides of `--cuda-context-mib` / `--fragmentation` (and a sweep's `runtime:`), checked,
    as `estimate(runtime=...)` takes them; None when neither is given."""
    from planner.io import number

    out: dict[str, Any] = {}
    if cuda_context_mib is not None:
        number(cuda_context_mib, "--cuda-context-mib", low=0, high=MAX_RUNTIME_BYTES / 2**20)
        out["cuda_context_bytes"] = int(cuda_context_mib * 2**20)
    if fragmentation is not None:
        out["fragmentation"] = number(fragmentation, "--fragmentation", low=0, high=MAX_FRAGMENTATION)
    return out or None

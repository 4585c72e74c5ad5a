"""GPU and instance data (planner/data/*.json), lookups, and the runtime constants built from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import hardware
from planner.errors import PlannerError
from planner.memory import runtime
from planner.spec import GPU, Instance

DATA = Path(hardware.__file__).parent / "data"
REQUIRED_INSTANCES = (
    ["ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge",
     "ml.p5.48xlarge"]
    + [f"ml.g4dn.{s}" for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge")]
    + [f"ml.{f}.{s}" for f in ("g5", "g6", "g6e")
       for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge")]
)


def test_json_files_are_valid_and_complete():
    gpus = json.loads((DATA / "gpus.json").read_text())["gpus"]
    instances = json.loads((DATA / "instances.json").read_text())["instances"]
    for key, rec in gpus.items():
        GPU.model_validate({k: v for k, v in hardware._gpu_from_record(rec).model_dump().items()})
        assert rec["sources"], key
    for name, rec in instances.items():
        assert rec["gpu"] in gpus, name
        assert rec["allreduce_source"], name
    assert set(REQUIRED_INSTANCES) <= set(instances)


def test_every_instance_is_an_instance_with_a_dated_sourced_price_or_a_reason():
    for name in hardware.list_instances():
        inst = hardware.get_instance(name)
        assert isinstance(inst, Instance)
        assert inst.price_source, name  # a URL and date, or why there is no price
        if inst.price_per_hour is not None:
            assert inst.price_per_hour > 0 and inst.price_date, name
        assert inst.price_region == "us-east-1"
        # One-GPU instances have no intra-instance all-reduce; multi-GPU ones must have a bandwidth.
        assert (inst.allreduce_bandwidth_gbs > 0) == (inst.gpus > 1), name


def test_lookup_is_case_insensitive_and_prefix_optional():
    assert hardware.get_instance("ML.P3.16XLARGE").name == "ml.p3.16xlarge"
    assert hardware.get_instance("p3.16xlarge").gpus == 8
    assert hardware.get_instance(" g5.xlarge ").gpu.family == "A10G"


def test_unknown_instance_suggests_closest_names():
    with pytest.raises(PlannerError) as err:
        hardware.get_instance("ml.p3.16xlarg")
    msg = str(err.value)
    assert "--instance" in msg and "ml.p3.16xlarge" in msg
    with pytest.raises(PlannerError, match="ml.g5"):
        hardware.get_instance("g5.xxlarge")


def test_v100_and_t4_have_no_bf16_and_no_flash_attention():
    for family in ("V100", "T4"):
        gpu = hardware.get_gpu(family)
        assert gpu.compute_capability < (8, 0)
        assert not gpu.bf16 and not gpu.flash_attention
        assert "bf16" not in gpu.peak_tflops and "tf32" not in gpu.peak_tflops
    for family in ("A10G", "L4", "L40S", "A100", "H100", "H200"):
        gpu = hardware.get_gpu(family)
        assert gpu.compute_capability >= (8, 0) and gpu.bf16 and gpu.flash_attention
        assert gpu.peak_tflops["bf16"] > gpu.peak_tflops["fp32"]


def test_memory_is_nominal_gib_and_driver_reports_less():
    v100 = hardware.get_gpu("V100-16GB")
    assert v100.memory_bytes == 16 * 2**30
    for key in hardware.list_gpus():
        gpu = hardware.get_gpu(key)
        if gpu.reported_memory_bytes is None:  # not published: the row says so
            assert "nvidia-smi" in hardware.gpu_table()[key]["notes"], key
            continue
        # the driver's total is a little under the nominal size (ECC, firmware reservations)
        assert 0.93 * gpu.memory_bytes < gpu.reported_memory_bytes <= gpu.memory_bytes, key
    assert hardware.get_instance("ml.p3dn.24xlarge").gpu.memory_bytes == 32 * 2**30
    assert hardware.get_instance("ml.p4de.24xlarge").gpu.memory_bytes == 80 * 2**30


def test_list_instances_filters_by_gpu():
    assert hardware.list_instances("V100") == ["ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge"]
    assert hardware.list_instances("a100-80gb") == ["ml.p4de.24xlarge"]
    with pytest.raises(PlannerError):
        hardware.get_gpu("X100")


# ---- runtime constants --------------------------------------------------------------------------


def test_cublas_workspace_follows_pytorch_defaults():
    # CublasHandlePool.cpp: ":4096:2:16:8" (8,519,680 B) except sm90 (32 MiB); + 1 MiB cuBLASLt; two handles.
    v100 = runtime.runtime_constants(hardware.get_gpu("V100"), calibration={})
    h100 = runtime.runtime_constants(hardware.get_gpu("H100"), calibration={})
    assert v100.cublas_workspace_bytes == 2 * (8_519_680 + 1_048_576)
    assert h100.cublas_workspace_bytes == 2 * (33_554_432 + 1_048_576)
    l40s = runtime.runtime_constants(hardware.get_gpu("L40S"), calibration={})  # sm89 is not Hopper
    assert l40s.cublas_workspace_bytes == v100.cublas_workspace_bytes


def test_runtime_defaults_are_plausible_per_family():
    for family in hardware.gpu_families():
        rc = runtime.runtime_constants(hardware.get_gpu(family), calibration={})
        assert 256 * 2**20 <= rc.cuda_context_bytes <= 1024 * 2**20
        assert 0 <= rc.fragmentation < 0.5
        assert rc.source


def test_overrides_and_calibration_precedence(tmp_path):
    gpu = hardware.get_gpu("A100")
    cal = {"families": {"A100": {"cuda_context_bytes": 123, "fragmentation": 0.2}, "V100": {"fragmentation": 0.3}},
           "source": "probe 2025-01"}
    rc = runtime.runtime_constants(gpu, calibration=cal)
    assert rc.cuda_context_bytes == 123 and rc.fragmentation == 0.2
    rc = runtime.runtime_constants(gpu, {"fragmentation": 0.05}, calibration=cal)
    assert rc.fragmentation == 0.05 and rc.cuda_context_bytes == 123 and "overridden" in rc.source
    with pytest.raises(PlannerError, match="runtime override"):
        runtime.runtime_constants(gpu, {"cuda_ctx": 1}, calibration={})
    # the file hook: absent -> {}, present -> its dict
    assert runtime.load_calibration(tmp_path / "none.json") == {}
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps(cal))
    assert runtime.calibrated_values(runtime.load_calibration(f), "V100") == {"fragmentation": 0.3}


def test_nccl_buffers_only_with_peers():
    rc = runtime.runtime_constants(hardware.get_gpu("V100"), calibration={})
    assert runtime.nccl_bytes(rc, 1) == 0
    assert runtime.nccl_bytes(rc, 2) == rc.nccl_bytes_per_peer
    assert runtime.nccl_bytes(rc, 8) == runtime.nccl_bytes(rc, 64) == 2 * rc.nccl_bytes_per_peer

"""The catalog is the SageMaker API's list (issue 22): every GPU training type botocore knows is modelled or
listed as unsupported with its reason; unpublished figures are null in the data and named where assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import hardware
from planner.errors import PlannerError
from planner.memory import runtime

SHARED_H200 = Path(__file__).resolve().parents[1] / "results" / "validation" / "h200" / "shared-2026-11-26" / "env.json"


def _api_gpu_types() -> list[str]:
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    return [t for t in model.shape_for("TrainingInstanceType").enum if t.startswith(("ml.p", "ml.g"))]


def test_every_gpu_training_type_of_the_api_is_modelled_or_unsupported_with_a_reason():
    api = _api_gpu_types()
    assert len(api) >= 58  # the installed botocore's count when this was written
    modelled, unsupported = set(hardware.list_instances()), hardware.unsupported_instances()
    missing = [t for t in api if t not in modelled and t not in unsupported]
    assert not missing, f"add these to planner/data/instances.json: {missing}"
    assert not modelled & set(unsupported)
    for name, row in unsupported.items():
        assert row["reason"], name


def test_an_unsupported_type_is_a_one_line_error_with_its_reason():
    with pytest.raises(PlannerError) as err:
        hardware.get_instance("ml.p2.8xlarge")
    assert "K80" in str(err.value) and "\n" not in str(err.value)


def test_p5e_predicts_for_the_h200_and_the_h200_row_matches_the_reading():
    inst = hardware.get_instance("ml.p5e.48xlarge")
    assert inst.gpu.family == "H200" and inst.gpus == 8
    if not SHARED_H200.exists():
        pytest.skip("shared/gpu-readings not beside the repository")
    env = json.loads(SHARED_H200.read_text())
    assert tuple(int(x) for x in env["cc"].split(".")) == inst.gpu.compute_capability
    assert env["sm"] == inst.gpu.sm_count
    smi_mib = int(env["nvidia_smi"].split(",")[2].split()[0])
    assert inst.gpu.reported_memory_bytes == smi_mib * 2**20


def test_null_figures_are_explained_and_assumed_ones_are_named():
    for key, row in hardware.gpu_table().items():
        nulls = [k for k, v in row.items() if v is None] + [f"peak_tflops.{k}" for k, v in row["peak_tflops"].items()
                                                            if v is None]
        if nulls:
            assert row.get("notes"), f"{key}: null {nulls} without a note"
        for path, entry in (row.get("assumed") or {}).items():
            assert entry["why"].startswith("ASSUMPTION"), (key, path)
    g7e = hardware.get_instance("ml.g7e.12xlarge")
    lines = g7e.gpu.assumptions + g7e.assumptions
    assert any("peak_tflops.bf16 = 500.0 assumed" in line for line in lines)
    assert any("network_gbps" in line for line in lines)


def test_an_estimate_on_an_assumed_figure_says_which_value_it_assumed():
    from planner import TrainConfig, estimate

    est = estimate("bert-base-uncased", TrainConfig(batch_size=4, seq_len=128, precision="bf16"), "ml.g7e.2xlarge")
    assert any("peak_tflops.bf16 = 500.0 assumed" in n for n in est.notes)
    plain = estimate("bert-base-uncased", TrainConfig(batch_size=4, seq_len=128, precision="bf16"), "ml.g6e.2xlarge")
    assert not any("assumed (" in n for n in plain.notes)


def test_every_non_k80_api_type_gives_an_estimate():
    from planner import TrainConfig, estimate

    for name in _api_gpu_types():
        if name in hardware.unsupported_instances():
            continue
        inst = hardware.get_instance(name)
        precision = "bf16" if inst.gpu.bf16 else "amp-fp16"
        est = estimate("bert-base-uncased", TrainConfig(batch_size=2, seq_len=64, precision=precision), name)
        assert est.throughput.samples_per_s > 0, name


def test_runtime_defaults_are_data_per_gpu_row():
    assert not hasattr(runtime, "CUDA_CONTEXT_MIB") and not hasattr(runtime, "NCCL_CHANNELS")
    for key in hardware.list_gpus():
        gpu = hardware.get_gpu(key)
        rt = runtime.default_runtime(gpu)
        assert rt["cuda_context_bytes"] == gpu.cuda_context_mib * 2**20, key
        assert rt["nccl_bytes_per_peer"] == gpu.nccl_channels * runtime.NCCL_BYTES_PER_CHANNEL_PEER, key
        assert gpu.runtime_source, key
    bare = hardware.get_gpu("T4").model_copy(update={"cuda_context_mib": None, "nccl_channels": None})
    assert runtime.default_runtime(bare)["cuda_context_bytes"] == runtime.CUDA_CONTEXT_DEFAULT_MIB * 2**20


def test_each_gpu_gets_a_probe_image_and_blackwell_gets_cuda_12_8_or_later():
    from planner.aws.images import choose_image
    from planner.memory.stack import default_stack

    for name in hardware.list_instances():
        inst = hardware.get_instance(name)
        choice = choose_image(name, "us-east-1")
        assert name and choice.uri, name
        stack = default_stack(inst.gpu)
        if inst.gpu.compute_capability >= (10, 0):
            major, minor = (int(x) for x in stack.cuda.split("."))
            assert (major, minor) >= (12, 8), (name, stack.cuda)

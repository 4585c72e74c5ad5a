"""planner validate / calibrate: signed errors, fit agreement, medians, the calibration file, the store."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from planner.probes import calibrate as cal
from planner.probes import store
from planner.probes.validate import compare, gpu_family, signed_error_pct, summary, validate

runner = CliRunner()
MIB = 2**20


def record(rid: str, *, status: str = "ok", gpu: str = "Tesla V100-SXM2-16GB", context: int = 500 * MIB,
           allocated: int = 1000 * MIB, reserved: int = 1100 * MIB, sps: float = 100.0, est: dict | None = None,
           device: str = "cuda", world: int = 1) -> dict:
    device_peak = reserved + context
    return {"record_id": rid, "status": status, "device": device, "gpu_name": gpu, "model": "m",
            "instance": "ml.p3.2xlarge", "world_size": world,
            "config": {"batch_size": 8, "seq_len": 128, "precision": "fp32", "parallelism": "single"},
            "tensors": {"parameters_bytes": 400, "local_parameters_bytes": 400, "gradients_bytes": 400,
                        "optimizer_state_bytes": 800, "saved_tensor_bytes": 333},
            "summary": {"peak_allocated": allocated, "peak_reserved": reserved, "device_peak": device_peak,
                        "cuda_context": context, "activations": 2000, "model_states_after_first_step": 1700,
                        "samples_per_s": sps, "saved_tensor_bytes": 333},
            "estimate": est}


def estimate(*, peak_allocated=1000 * MIB, context=400 * MIB, frag=0.10, sps=120.0, fits=True,
             gpu="NVIDIA V100-SXM2-16GB") -> dict:
    reserved = int(peak_allocated * (1 + frag))
    return {"gpu": gpu, "fits": fits,
            "memory_bytes": {"parameters": 440, "gradients": 400, "optimizer_states": 800, "batch": 100,
                             "activations": 1800, "peak_allocated": peak_allocated, "peak_reserved": reserved,
                             "cuda_context": context, "nccl": 0, "peak_device": reserved + context},
            "throughput": {"samples_per_s": sps}}


def test_signed_error():
    assert signed_error_pct(110, 100) == pytest.approx(10.0)
    assert signed_error_pct(90, 100) == pytest.approx(-10.0)
    assert signed_error_pct(None, 100) is None and signed_error_pct(5, 0) is None


def test_compare_terms_and_fit_agreement():
    row = compare(record("a"), estimate(), "stored")
    assert row.errors["parameters"] == pytest.approx(10.0)  # 440 predicted vs 400 measured
    assert row.errors["activations"] == pytest.approx(-10.0)  # 1800 vs 2000
    assert row.errors["model_states"] == pytest.approx((1740 - 1700) / 1700 * 100)
    assert row.errors["samples_per_s"] == pytest.approx(20.0)
    assert row.fit_agrees is True
    oom = compare(record("b", status="oom"), estimate(fits=True), "stored")
    assert oom.fit_agrees is False and oom.errors["peak_allocated"] is None
    other_gpu = compare(record("c", gpu="NVIDIA A10G"), estimate(), "stored")
    assert other_gpu.fit_agrees is None and other_gpu.notes
    cpu = compare(record("d", device="cpu", gpu=None), estimate(), "stored")
    assert cpu.measured["activations"] == 333 and cpu.measured["peak_allocated"] is None


def test_validate_falls_back_to_stored_predictions_and_skips_unmeasured():
    recs = [record("a", est=estimate()), record("u", status="unsupported", est=estimate())]

    def broken(_rec):
        raise RuntimeError("estimator not ready")

    rows = validate(recs, estimate_fn=broken)
    assert [r.record_id for r in rows] == ["a"]
    assert rows[0].prediction_source.startswith("stored") and rows[0].errors["parameters"] == pytest.approx(10.0)
    s = summary(rows)
    assert s["parameters"]["n"] == 1 and s["fit_agreement"]["rate"] == 1.0


def test_gpu_family_names():
    assert gpu_family("Tesla V100-SXM2-16GB") == "V100"
    assert gpu_family("NVIDIA A10G") == "A10G"
    assert gpu_family("NVIDIA L40S") == "L40S" and gpu_family("NVIDIA L4") == "L4"
    assert gpu_family("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_family(None) is None


def test_calibration_uses_medians_and_reports_leave_one_out():
    contexts = [500 * MIB, 520 * MIB, 10_000 * MIB]  # one run shared its GPU: the median ignores it
    recs = [record(f"r{i}", context=c, reserved=int(1000 * MIB * (1 + f)), sps=s)
            for i, (c, f, s) in enumerate(zip(contexts, (0.05, 0.07, 0.30), (90.0, 100.0, 110.0), strict=True))]
    est = {r["record_id"]: estimate() for r in recs}
    result = cal.calibrate(recs, est)
    v100 = result["families"]["V100"]
    assert v100["cuda_context_bytes"] == 520 * MIB
    assert v100["fragmentation"] == pytest.approx(0.07, abs=1e-9)
    assert v100["throughput_scale"] == pytest.approx(100.0 / 120.0)
    rep = result["report"]["V100"]
    assert rep["after"]["samples_per_s"] < rep["before"]["samples_per_s"]
    assert rep["after_leave_one_out"]["device_peak"] is not None
    # Multi-GPU runs carry NCCL buffers outside the allocator: they do not inform the CUDA context.
    multi = cal.calibrate([record("m", world=2, context=900 * MIB)], {"m": estimate()})
    assert "cuda_context_bytes" not in multi["families"]["V100"]


def test_calibration_file_is_what_the_runtime_loader_reads(tmp_path):
    from planner.hardware import get_gpu
    from planner.memory.runtime import load_calibration, runtime_constants

    recs = [record("r1", context=600 * MIB, reserved=1050 * MIB)]
    doc = cal.calibration_document(cal.calibrate(recs, {"r1": estimate()}), 1)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal.merge_into(path, doc)))
    v100 = get_gpu("V100")
    rt = runtime_constants(v100, calibration=load_calibration(path))
    assert rt.cuda_context_bytes == 600 * MIB
    assert rt.fragmentation == pytest.approx(0.05)
    # Calibrating another family later keeps V100's entry.
    path.write_text(json.dumps(cal.merge_into(path, {"families": {"A10G": {"fragmentation": 0.2}}})))
    assert set(json.loads(path.read_text())["families"]) == {"V100", "A10G"}


def test_store_redacts_and_upserts(tmp_path):
    rec = record("job-1", est=estimate())
    rec["failure_reason"] = "role arn:aws:iam::111122223333:role/Secret denied; bucket sagemaker-us-east-1-111122223333"
    rec["RoleArn"] = "arn:aws:iam::111122223333:role/Secret"
    store.save_record(rec, tmp_path)
    text = (tmp_path / "probes" / "job-1.json").read_text()
    assert "111122223333" not in text and "RoleArn" not in text
    store.update_parquet(store.load_records(root=tmp_path), tmp_path)
    store.update_parquet(store.load_records(root=tmp_path), tmp_path)
    table = pd.read_parquet(store.parquet_path(tmp_path))
    assert len(table) == 1 and table.loc[0, "pred_peak_allocated"] == 1000 * MIB


def test_validate_and_calibrate_commands(tmp_path, monkeypatch):
    from planner.cli.main import app

    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    folder = tmp_path / "validation" / "V100"
    for i, ctx in enumerate((500 * MIB, 540 * MIB)):
        store.write_json_atomic(folder / f"r{i}.json", record(f"r{i}", context=ctx, est=estimate()))
    res = runner.invoke(app, ["validate", "--probes", str(folder), "--stored", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["rows"]) == 2 and out["summary"]["fit_agreement"]["n"] == 2
    csv = pd.read_csv(out["csv"])
    assert set(csv["term"]) >= {"activations", "peak_reserved", "device_peak", "samples_per_s"}
    res = runner.invoke(app, ["calibrate", "--probes", str(folder), "--json"])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "results" / "calibration.json").read_text())
    assert written["families"]["V100"]["cuda_context_bytes"] == 520 * MIB
    empty = runner.invoke(app, ["validate", "--probes", str(tmp_path / "nothing")])
    assert empty.exit_code == 2 and "--probes" in empty.stderr

"""A calibration file written by `planner calibrate` changes what estimate (and so search) predicts."""

from __future__ import annotations

import json

import planner
from planner.spec import TrainConfig


def test_calibration_file_is_used(tmp_path, monkeypatch):
    cfg = TrainConfig(batch_size=8, seq_len=128)
    before = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"families": {"V100": {"cuda_context_bytes": 700 * 2**20, "fragmentation": 0.25,
                                                      "throughput_scale": 0.5}}}))
    monkeypatch.setenv("PLANNER_CALIBRATION", str(path))
    after = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge")
    assert after.memory_bytes.cuda_context == 700 * 2**20
    assert after.memory_bytes.peak_reserved > before.memory_bytes.peak_reserved
    assert after.throughput.samples_per_s == before.throughput.samples_per_s * 0.5
    other = planner.estimate("bert-base-uncased", cfg, "ml.g5.xlarge")  # another family: untouched
    assert other.runtime.cuda_context_bytes != 700 * 2**20


def test_a_rewritten_calibration_file_is_read_again(tmp_path, monkeypatch):
    """Read once per file version (a search estimates thousands of configurations), and again when the file
    changes: `planner calibrate` may rewrite it between two searches of one process."""
    import os

    from planner.memory import runtime

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("PLANNER_CALIBRATION", str(path))
    assert runtime.load_calibration() == {}
    path.write_text(json.dumps({"families": {"V100": {"throughput_scale": 0.5}}}))
    first = runtime.load_calibration()
    assert first["families"]["V100"]["throughput_scale"] == 0.5
    assert runtime.load_calibration() is first  # not re-read
    path.write_text(json.dumps({"families": {"V100": {"throughput_scale": 0.25}}}))
    os.utime(path, ns=(1, 1))  # a different version even on a coarse clock
    assert runtime.load_calibration()["families"]["V100"]["throughput_scale"] == 0.25


def test_an_estimate_follows_a_rewritten_calibration_file(tmp_path, monkeypatch):
    """What an estimate derives from the calibration (runtime constants, the context band) is kept per file
    version, not per process: the next estimate after a rewrite uses the new file."""
    import os

    cfg = TrainConfig(batch_size=8, seq_len=128)
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("PLANNER_CALIBRATION", str(path))
    contexts = []
    for i, mib in enumerate((700, 900)):
        path.write_text(json.dumps({"families": {"V100": {"cuda_context_bytes": mib * 2**20}}}))
        os.utime(path, ns=(i + 1, i + 1))  # a different version even on a coarse clock
        contexts += [planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge").memory_bytes.cuda_context
                     for _ in range(2)]
    assert contexts == [700 * 2**20] * 2 + [900 * 2**20] * 2


def test_a_calibration_passed_in_is_the_file_s_answer_without_the_file(tmp_path, monkeypatch):
    """`estimate(calibration=...)` (planner.pipeline.resolve): the same estimate as the file would give,
    with no file read; {} is no calibration whatever the working directory holds."""
    cal = {"families": {"V100": {"cuda_context_bytes": 700 * 2**20, "fragmentation": 0.25, "throughput_scale": 0.5}}}
    cfg = TrainConfig(batch_size=8, seq_len=128)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("PLANNER_CALIBRATION", str(path))
    from_file = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge")
    ignored = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", calibration={})
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "absent.json"))
    passed = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", calibration=cal)
    plain = planner.estimate("bert-base-uncased", cfg, "ml.p3.2xlarge")
    assert passed.to_json() == from_file.to_json()
    assert ignored.to_json() == plain.to_json() != passed.to_json()

"""`explain --json` on random configurations (LoRA / QLoRA, runs of varying lengths, every parallelism): each
answer is strict JSON (no NaN / Infinity) or a one-line refusal of a bad combination. Prints how many of each
and the time per explain. The test (tests/test_bad_input_37.py) runs a few examples; this runs 100.

Usage: python benchmarks/explain_json_property.py [--examples N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    args = parser.parse_args()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.test_bad_input_37 import check_explain_json, explain_args

    tmp = Path(tempfile.mkdtemp())
    os.environ["PLANNER_CALIBRATION"] = str(tmp / "no-calibration.json")
    os.environ["PLANNER_PRICES"] = str(tmp / "no-prices.json")
    times: list[float] = []
    outcomes = {"explained": 0, "refused": 0}

    @settings(max_examples=args.examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        argv = explain_args(data.draw)
        t0 = time.perf_counter()
        ok = check_explain_json(argv)
        times.append(time.perf_counter() - t0)
        outcomes["explained" if ok else "refused"] += 1

    t0 = time.perf_counter()
    run()
    total = time.perf_counter() - t0
    print(f"{len(times)} configurations: {outcomes['explained']} explained as strict JSON, "
          f"{outcomes['refused']} refused in one line; 0 failures")
    print(f"explain time: median {statistics.median(times):.2f} s, max {max(times):.2f} s, total {total:.0f} s")


if __name__ == "__main__":
    main()

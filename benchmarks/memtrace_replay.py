"""The planner's allocator model against PyTorch's own allocator, on the allocator's record of real runs.

    python benchmarks/memtrace_replay.py FOLDER        (a folder with memtrace.jsonl)

Each row of memtrace.jsonl (`benchmarks/gpu_session.py run --sections memtrace`) holds the caching
allocator's trace of a model's build and two training steps: every request with its size and address, every
free, every new segment. The same requests and frees, in the same order, go through the planner's model
(`planner.memory.allocator_trace.check`); printed per row: the requests, the segments the real allocator
made and the model's, the first segment that differs and the first block the model puts elsewhere (-: none),
and both reserved peaks. Where they agree, the model's rules are the allocator's on that workload, and what
remains of a reserved error is the order and sizes of the requests the planner predicts (its per-block or
traced trace), not the allocator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_session import TRACE_CODES  # noqa: E402

GiB = 2**30
# memtrace.jsonl's one-letter actions -> torch's TraceEntry action names
ACTION_OF = {code: action for action, code in TRACE_CODES.items()}


def rows(folder: Path) -> list[dict]:
    from planner.errors import PlannerError

    path = folder / "memtrace.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise PlannerError("FOLDER", str(folder), f"a folder holding memtrace.jsonl ({exc.strerror})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise PlannerError(str(path), f"line {n}", "a JSON object per line") from None
        if not isinstance(row, dict):
            raise PlannerError(str(path), f"line {n}", "a JSON object per line") from None
        if row.get("status", "ok") == "ok" and not isinstance(row.get("trace"), list):
            raise PlannerError(str(path), f"line {n}", "a successful row with a trace list") from None
        out.append(row)
    return out


def entries(row: dict) -> list[dict]:
    return [{"action": ACTION_OF.get(a, a), "addr": addr, "size": size} for a, addr, size in row["trace"]]


def main(argv: list[str] | None = None) -> int:
    from planner.errors import PlannerError
    from planner.memory.allocator_trace import check, entries_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    try:
        table = rows(args.folder)
        print(f"{'row':<38}{'requests':>9}{'segments':>9}{'model':>6}{'diff':>5}{'moved':>7}"
              f"{'real GiB':>9}{'model':>7}")
        for row in table:
            name = f"{row['name']} " if row.get("name") else ""
            label = f"{name}{row.get('model', '?')} b{row.get('b')} s{row.get('s')} {row.get('precision', '')}"
            if row.get("status", "ok") != "ok":
                print(f"{label[:37]:<38}  (no trace: the row ended {row.get('status')})")
                continue
            if not row["trace"]:
                print(f"{label[:37]:<38}  (no trace: recorded without a GPU)")
                continue
            r = check(entries_of(entries(row)))
            print(f"{label[:37]:<38}{r.allocations:>9}{len(r.real_segments):>9}{len(r.model_segments):>6}"
                  f"{r.first_difference if r.first_difference >= 0 else '-':>5}"
                  f"{r.first_misplaced if r.first_misplaced >= 0 else '-':>7}"
                  f"{r.real_peak_reserved / GiB:>9.2f}{r.model_peak_reserved / GiB:>7.2f}")
    except PlannerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

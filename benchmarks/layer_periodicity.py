"""Does the allocator's state repeat from one transformer layer to the next? (prints)

Why: a replay could skip identical layers (fast-forward) only if, after layer i, the allocator's free blocks
(their sizes and pools in address order: all that best fit, splitting and merging look at) were those after
layer i-1: then layer i+1 would do exactly what layer i did. This counts, over the configurations of
benchmarks/estimate_benchmark.py --quick, the forward and backward layer windows whose free-block list equals
the previous layer's (and one of the last four: a short period).
Usage: python benchmarks/layer_periodicity.py
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYER_END = re.compile(r"layer\.\d+\.(forward|backward) transient$")


def main() -> None:
    from estimate_benchmark import INSTANCES, configs

    from planner.memory import allocator, reserved

    est = importlib.import_module("planner.estimate")
    counts = {"forward": [0, 0, 0], "backward": [0, 0, 0]}  # windows, equal to previous, equal to one of last 4
    for model, cfg in configs(True):
        prep = est._prepare(model, cfg, INSTANCES[0], None, "cuda", None)
        trace = reserved._build_trace(prep.spec, prep.cfg, prep.step, prep.activations, 1.0, 1.0, 1.0, "cuda")
        a = allocator.CachingAllocator()
        live: dict = {}
        seen: dict[str, list] = {"forward": [], "backward": []}
        for tid, n in trace.events:
            if n:
                live[tid] = a.malloc(n)[0]
                continue
            a.free(live.pop(tid))
            m = LAYER_END.search(trace.names[tid])
            if m is None:  # a layer's window ends when its transient is freed
                continue
            phase = m.group(1)
            state = tuple((b.size, b.small) for b in sorted(a.free_at.values(), key=lambda b: b.addr))
            history = seen[phase]
            if history:
                c = counts[phase]
                c[0] += 1
                c[1] += history[-1] == state
                c[2] += state in history[-4:]
            history.append(state)
    for phase, (windows, same, short) in counts.items():
        print(f"{phase:8s} layer windows {windows:5d}: free blocks as after the previous layer {same:5d}, "
              f"as after one of the last 4 {short:5d}")


if __name__ == "__main__":
    main()

"""Random allocator event streams for property tests (`allocator.fast_run`, the compiled kernel)."""

from __future__ import annotations

from hypothesis import strategies as st

MiB = 1024 * 1024

# Request sizes around every threshold of the rules: 512 B rounding, the 1 MiB small pool, 10 MiB kMinLargeAlloc,
# 20 MiB kLargeBuffer, plus arbitrary sizes.
SIZES = st.one_of(st.integers(1, 4096), st.integers(MiB - 1024, MiB + 1024), st.integers(1, 3 * MiB),
                  st.integers(10 * MiB - 1024, 10 * MiB + 1024), st.integers(1, 64 * MiB))


@st.composite
def event_streams(draw):
    """Allocations and frees in any order; some frees follow their allocation at once (transients)."""
    ops = draw(st.lists(st.tuples(st.sampled_from(["alloc", "transient", "free"]), SIZES, st.integers(0, 10**6)),
                        max_size=250))
    out, live, nid = [], [], 0
    for op, size, pick in ops:
        if op == "free" and live:
            out.append((live.pop(pick % len(live)), 0))
            continue
        out.append((nid, size))
        if op == "transient":
            out.append((nid, 0))
        else:
            live.append(nid)
        nid += 1
    return out

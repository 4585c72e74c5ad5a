"""Human-readable sizes and rates."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


def fmt_bytes(n: float) -> str:
    """Binary units, as nvidia-smi and torch.cuda report them."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GIB:
        return f"{sign}{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{sign}{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))

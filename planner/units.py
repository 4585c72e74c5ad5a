"""Human-readable sizes and rates."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


# Units above GiB, so that an absurd configuration (a micro-batch of 10^9) prints "3.16 EiB", short enough for
# a table cell, rather than "3646102906.68 GiB" folded mid-digit; beyond YiB the figure gets separators.
LARGE_UNITS = (("YiB", 2**80), ("ZiB", 2**70), ("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40))


def fmt_bytes(n: float) -> str:
    """Binary units, as nvidia-smi and torch.cuda report them."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in LARGE_UNITS:
        if n >= size:
            return f"{sign}{n / size:,.2f} {unit}"
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

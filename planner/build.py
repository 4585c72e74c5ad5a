"""Which build of the estimator made a figure: a digest of the package's code and sourced data.

A study keeps it so that a search resumed by another build (whose memory, speed or cost model differ) does
not rank its new figures against the old ones. A digest rather than the package version, which does not
change with every fix of a formula.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from planner import caches

SOURCES = (".py", ".json", ".yaml")


@caches.lru(None, scope="facts", key="none: the planner's own files")
def estimator_build() -> str:
    """12 hex digits over every source and data file of `planner` (paths and contents; ~5 ms, once)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in SOURCES and "__pycache__" not in path.parts and path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]

"""Load a Python file as a module under a chosen name: the job scripts in jobs/ (which SageMaker runs as
files, not as a package) and users' model files, as the tests import them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module(name: str, path: Path) -> ModuleType:
    """`path` executed as module `name`, registered in sys.modules (the probe job imports its siblings by
    name: `modeling`, `parallel_layout`)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

"""Test-session settings.

Traces are kept on disk between processes (planner.program.trace_cache); the tests keep theirs in a folder of
their own, so they neither read a developer's cache nor leave files in the home folder (subprocesses inherit
it). A test that checks the cache itself sets its own folder.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("PLANNER_CACHE_DIR", tempfile.mkdtemp(prefix="planner-tests-cache-"))

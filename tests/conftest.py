"""Test-session settings.

Traces are kept on disk between processes (planner.program.trace_cache); the tests keep theirs in a folder of
their own, so they neither read a developer's cache nor leave files in the home folder (subprocesses inherit
it). A test that checks the cache itself sets its own folder.
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("PLANNER_CACHE_DIR", tempfile.mkdtemp(prefix="planner-tests-cache-"))


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group (world size 1) for tests of torch.distributed's own behaviour on CPU (FSDP1,
    FSDP2), torn down after the test."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

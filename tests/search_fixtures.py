"""Fixtures for the search tests: a fake estimate (to test the search machinery on its own) and a real,
throw-away PostgreSQL server.

The fake estimate is a toy with the shape of the real one (memory grows with batch × sequence,
AMP and checkpointing shrink activations, checkpointing costs speed, bf16 needs a bf16 GPU), so a test
of the machinery does not depend on the real formulas; tests of the real objective use planner.estimate.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from glob import glob
from pathlib import Path

from planner.errors import PlannerError
from planner.spec import (
    Cost,
    Estimate,
    Instance,
    MemoryBytes,
    ModelSpec,
    RuntimeConstants,
    Throughput,
    TrainConfig,
)

GIB = 1024**3
FAKE_RUNTIME = RuntimeConstants(cuda_context_bytes=GIB // 2, cublas_workspace_bytes=8 << 20, nccl_bytes_per_peer=0,
                                fragmentation=0.0, source="fake")


def fake_estimate(model: ModelSpec, config: TrainConfig, instance: Instance, *, dataset_size: int | None = None,
                  spot: bool = False, **_: object) -> Estimate:
    """A toy estimate: fixed 2 GiB of states plus activations ∝ batch × seq, halved by AMP, /5 by checkpointing."""
    if "bf16" in config.precision and not instance.gpu.bf16:
        raise PlannerError("--precision", config.precision, f"{instance.gpu.family} has no bf16")
    if model.max_positions is not None and config.seq_len > model.max_positions:
        raise PlannerError("--seq-len", config.seq_len, f"<= {model.max_positions}")
    amp = config.precision != "fp32"
    act = config.batch_size * config.seq_len * 400_000 // (2 if amp else 1) // (5 if config.checkpointing else 1)
    states = 2 * GIB
    peak = FAKE_RUNTIME.cuda_context_bytes + states + act
    gpu_mem = instance.gpu.memory_bytes
    world = instance.gpus * config.instances
    # Speed: saturates with batch, AMP ×2, checkpointing ×0.75, accumulation amortises a 10% all-reduce.
    per_gpu = 100.0 * (2.0 if amp else 1.0) * (0.75 if config.checkpointing else 1.0)
    per_gpu *= config.batch_size / (config.batch_size + 8) * 512 / config.seq_len
    per_gpu /= 1 + 0.1 / config.grad_accum
    samples = per_gpu * world
    gbs = config.batch_size * config.grad_accum * world
    price = (instance.price_per_hour or 10.0) * config.instances
    usd_m = price / (samples * 3600) * 1e6
    hours = dataset_size / samples / 3600 if dataset_size else None
    cfg = config.model_copy(update={"parallelism": "ddp" if world > 1 else "single"})
    return Estimate(
        model=model.name, instance=instance.name, gpu=instance.gpu.name, config=cfg, world_size=world,
        parameters={"total": 1}, memory_bytes=MemoryBytes(
            parameters=states // 4, gradients=states // 4, optimizer_states=states // 2, activations=act, batch=0,
            buffers=0, peak_allocated=states + act, peak_reserved=states + act,
            cuda_context=FAKE_RUNTIME.cuda_context_bytes, nccl=0, peak_device=peak),
        phases=(), peak_phase="backward", gpu_memory_bytes=gpu_mem, usable_memory_bytes=gpu_mem - GIB // 2,
        fits=peak <= gpu_mem, headroom_bytes=gpu_mem - peak, runtime=FAKE_RUNTIME,
        throughput=Throughput(step_time_s=gbs / samples, samples_per_s=samples, tokens_per_s=samples * config.seq_len,
                              mfu=0.3, global_batch_size=gbs),
        cost=Cost(price_per_hour=price, spot=spot, usd_per_million_samples=usd_m, dataset_size=dataset_size,
                  hours_per_epoch=hours, usd_per_epoch=hours * price if hours else None),
    )


# --------------------------------------------------------------------------------------- PostgreSQL


def postgres_bin_dir() -> Path | None:
    """Debian's `postgresql` package: /usr/lib/postgresql/<version>/bin (newest first), or PATH."""
    for d in sorted(glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if Path(d, "initdb").exists() and Path(d, "pg_ctl").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user(cmd: list[str], user: str | None) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as `user` then."""
    if user is None:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--", *cmd]
    return ["su", user, "-s", "/bin/sh", "-c", " ".join(cmd)]


def postgres_server() -> Iterator[str]:
    """Start a throw-away cluster on 127.0.0.1:<free port>, yield a SQLAlchemy URL, stop and delete it."""
    import pytest

    bindir = postgres_bin_dir()
    if bindir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    user = None
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
            user = "postgres"
        except KeyError:
            pytest.skip("running as root and no 'postgres' user to run the server as")
    root = Path(tempfile.mkdtemp(prefix="planner-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if user is not None:
        shutil.chown(root, user)
        shutil.chown(sock, user)
    port = _free_port()
    subprocess.run(_as_user([str(bindir / "initdb"), "-D", str(data), "-U", "planner", "--auth=trust", "-E", "UTF8"],
                            user), check=True, capture_output=True)
    log = root / "server.log"
    subprocess.run(_as_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o",
                             f"-h 127.0.0.1 -p {port} -k {sock} -c fsync=off", "start"], user),
                   check=True, capture_output=True)
    try:
        url = f"postgresql://planner@127.0.0.1:{port}/postgres"
        db = f"search_{int(time.time() * 1000)}"
        import sqlalchemy

        engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text(f"CREATE DATABASE {db}"))
        engine.dispose()
        yield f"postgresql://planner@127.0.0.1:{port}/{db}"
    finally:
        subprocess.run(_as_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], user),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)

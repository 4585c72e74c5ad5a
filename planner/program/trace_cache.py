"""Traces kept on disk, so that a second estimate of a traced model, in a new process, costs what a catalog
model's does.

Why: tracing T5-base runs ~9,000 ATen ops through FakeTensorMode twice (the two base micro-batches that
`planner.program.scale` interpolates) and imports transformers' modeling code: seconds, where a catalog
estimate takes a fraction of one. A trace is a pure function of its inputs, so it is kept, one file per
trace, under `$PLANNER_CACHE_DIR/traces` (default `$XDG_CACHE_HOME/planner/traces`, else
`~/.cache/planner/traces`); `PLANNER_TRACE_CACHE=0` turns it off.

The key is everything that changes the trace:
- what was traced: the source kind, the path as given and as an absolute path, the config.json's contents,
  the model options, the inputs and loss functions; the whole TrainConfig of the shape class (batch, length,
  precision, checkpointing, attention, optimizer, LoRA and base dtype), the backend and flash availability;
- the code that traced it: a digest of every file of the planner package (`.py` and data) and the versions
  of Python, torch, transformers, peft and bitsandbytes;
- for a model of your own: the digest of every Python file outside the standard library, site-packages and
  the planner that was loaded when the trace was made (your module and the local modules it imports), kept
  in the entry and checked when it is read.

A file that is truncated, corrupt (its SHA-256 is checked before unpickling), of another format, or made
for another key is ignored and traced again, and the new trace written over it. Writes go to a temporary
file renamed into place (`planner.io.atomic_path`), so a concurrent reader sees a whole file or none.
Pickle runs code named by the file, so only files under the user's own cache folder are read, as for any
cache of Python objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from planner import caches
from planner.env import choice
from planner.errors import PlannerError
from planner.program.records import StepTrace

MAGIC = b"planner-trace 1\n"  # format of the file: magic, SHA-256 of the payload (32 bytes), pickled payload
DIR_ENV = "PLANNER_CACHE_DIR"
MAX_ENTRIES = 512  # traces kept; the oldest go first (a T5-base trace is ~2 MB)
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")  # their versions change what a trace records
PLANNER_ROOT = Path(__file__).resolve().parents[1]


def enabled() -> bool:
    return choice("PLANNER_TRACE_CACHE") != "0"


def directory() -> Path:
    """Where traces are kept (module docstring)."""
    given = os.environ.get(DIR_ENV, "").strip()
    if given:
        return Path(given).expanduser() / "traces"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "planner" / "traces"


def _digest_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.relative_to(PLANNER_ROOT)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


@caches.lru(1, scope="facts", key="() - the planner's files and library versions of this process")
def code_version() -> str:
    """A digest of the planner's own files and the versions of the libraries a trace runs through: any
    change to the tracer, its rules or its data makes every earlier trace a miss."""
    from importlib import metadata

    files = sorted(p for p in PLANNER_ROOT.rglob("*") if p.suffix in (".py", ".json") and p.is_file()
                   and "__pycache__" not in p.parts)
    versions = []
    for name in LIBRARIES:
        try:
            versions.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name}=absent")
    return hashlib.sha256(f"{_digest_files(files)} {sys.version} {' '.join(versions)}".encode()).hexdigest()


def key_of(parts: dict[str, Any]) -> str:
    """The file name of the trace made from `parts` (what was traced) by this code."""
    text = json.dumps({"parts": parts, "code": code_version()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# module file -> its real path when it is local code (outside the standard library, site-packages and the
# planner), else None: decided once per file, as a search stores a trace per shape class
_LOCAL: dict[str, str | None] = caches.table("planner.program.trace_cache._LOCAL", key="module __file__",
                                             scope="model")


@caches.lru(1, scope="facts", key="() - this Python's library folders")
def _library_folders() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    skip = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    skip |= {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    skip.add(str(PLANNER_ROOT))
    return tuple(sorted(skip))


def _local(file: str) -> str | None:
    if file not in _LOCAL:
        real = os.path.realpath(file)
        inside = any(real == s or real.startswith(s + os.sep) for s in _library_folders())
        _LOCAL[file] = None if inside or not real.endswith(".py") else real
    return _LOCAL[file]


def local_sources() -> tuple[tuple[str, str], ...]:
    """(path, SHA-256) of every loaded Python file outside the standard library, site-packages and the
    planner: the user's module and what it imported from beside it."""
    out: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        real = _local(file) if isinstance(file, str) else None
        if real is None or real in out:
            continue
        digest = _file_digest(real)
        if digest is not None:
            out[real] = digest
    return tuple(sorted(out.items()))


def load(key: str) -> StepTrace | None:
    """The trace kept under `key`, or None (absent, unreadable, corrupt, stale user code)."""
    try:
        raw = (directory() / f"{key}.trace").read_bytes()
    except OSError:
        return None
    head = len(MAGIC)
    if not raw.startswith(MAGIC) or len(raw) < head + 32:
        return None
    payload = raw[head + 32:]
    if hashlib.sha256(payload).digest() != raw[head:head + 32]:
        return None
    try:
        entry = pickle.loads(payload)
    except Exception:  # noqa: BLE001 - a file of another planner version: traced again
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("trace"), StepTrace):
        return None
    for path, digest in entry.get("sources", ()):
        if _file_digest(path) != digest:
            return None
    return entry["trace"]


def store(key: str, trace: StepTrace, sources: tuple[tuple[str, str], ...] = ()) -> None:
    """Keep `trace` under `key` (atomically); a folder that cannot be written only means no cache."""
    from planner.io import atomic_path

    payload = pickle.dumps({"key": key, "trace": _shared(trace), "sources": sources},
                           protocol=pickle.HIGHEST_PROTOCOL)
    folder = directory()
    try:
        with atomic_path(folder / f"{key}.trace", "trace cache") as tmp:
            tmp.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
        _prune(folder)
    except (PlannerError, OSError):
        return


def _shared(trace: StepTrace) -> StepTrace:
    """An equal trace whose equal strings, tensor metadata and metadata tuples are one object each: pickle
    writes an object once and refers to it after, so T5-base's 23,566 op inputs and outputs (57 distinct)
    are read back as 57 objects (a file 3x smaller, read 3x faster)."""
    from dataclasses import replace

    from planner.program.records import OpRecord, StorageEvent

    memo: dict[Any, Any] = {}
    one = memo.setdefault
    tuples: dict[tuple, tuple] = {}  # metadata tuple -> the shared one (of shared TensorMetas)

    def metas(x: tuple) -> tuple:
        got = tuples.get(x)
        if got is None:
            got = tuple(one(m, m) for m in x)
            got = tuples[x] = x if all(a is b for a, b in zip(got, x, strict=True)) else got
        return got

    # positional constructors: `dataclasses.replace` per op and event was most of a search's writing time
    def event(e: StorageEvent) -> StorageEvent:
        action, dtype, category = one(e.action, e.action), one(e.dtype, e.dtype), one(e.category, e.category)
        if action is e.action and dtype is e.dtype and category is e.category:  # shared already (most are)
            return e
        return StorageEvent(e.op, action, e.storage, e.nbytes, dtype, category)

    def op(o: OpRecord) -> OpRecord:
        name, phase, module = one(o.name, o.name), one(o.phase, o.phase), one(o.module, o.module)
        inputs, outputs = metas(o.inputs), metas(o.outputs)
        if (name is o.name and phase is o.phase and module is o.module and inputs is o.inputs
                and outputs is o.outputs):
            return o
        return OpRecord(o.index, name, phase, module, inputs, outputs, o.flops, o.kernel)

    ops = tuple(op(o) for o in trace.ops)
    events = tuple(event(e) for e in trace.events)
    return replace(trace, ops=ops, events=events, op_blocks=tuple(one(b, b) for b in trace.op_blocks))


def _prune(folder: Path) -> None:
    entries = list(folder.glob("*.trace"))
    if len(entries) <= MAX_ENTRIES:
        return

    def age(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0
    for p in sorted(entries, key=age)[: len(entries) - MAX_ENTRIES]:
        try:
            p.unlink()
        except OSError:
            pass


def cached(parts: dict[str, Any], make: Callable[[], StepTrace], *, user_code: bool = False) -> StepTrace:
    """The trace of `parts` from the disk, else `make()` kept there. `user_code`: the trace ran the user's
    Python files, whose digests are kept and checked (module docstring)."""
    if not enabled():
        return make()
    key = key_of(parts)
    hit = load(key)
    if hit is not None:
        return hit
    trace = make()
    store(key, trace, local_sources() if user_code else ())
    return trace

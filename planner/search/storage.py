"""Where a search's trials persist: an Optuna journal file (default), SQLite, or a server (PostgreSQL).

Default: `results/<study>/journal.log`, Optuna's JournalStorage over a JournalFileBackend: each finished
trial is ONE appended JSON line (fsync'ed), where the RDB storage spends a transaction per parameter and
attribute (benchmarks/search_benchmark.py prints both). A line is written whole or not at all, so a
SIGKILL loses at most the trial in flight. optuna-dashboard opens the file (`optuna-dashboard
results/<study>/journal.log`). `--storage` also takes any Optuna RDB URL: `sqlite:///path.db` (WAL),
`postgresql://user@host/db` (SQLAlchemy 2.1 picks psycopg 3 for that scheme; `pip install .[postgres]`),
`mysql://...`; or a journal file path ending in .log.

Many workers, one study: `StudyLock` serialises the few steps that must not race (creating the study,
numbering the workers, checking the shared budget and writing a trial): an flock on a file beside a
journal or SQLite file (the kernel drops it when a process dies, so a killed worker never blocks the
others), a PostgreSQL advisory lock on a server.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError

if TYPE_CHECKING:  # pragma: no cover
    import optuna

JOURNAL_SUFFIXES = (".log", ".jsonl", ".journal")
STORAGE_ATTEMPTS = 8  # tries to open a database whose tables another worker is creating
# Errors of a database that another process is creating or writing at the same moment: retried.
RACE_MARKERS = ("already exists", "unique constraint", "duplicate key", "database is locked", "alembic_version")


def safe_url(url: str) -> str:
    """The URL with any password masked, for printing and JSON."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


@dataclass(frozen=True)
class StorageSpec:
    """A parsed --storage: kind 'journal' (a file path) or 'rdb' (an SQLAlchemy URL)."""

    kind: str
    target: str  # the file path or the URL

    @property
    def file(self) -> Path | None:
        """The local file holding the trials, when there is one."""
        if self.kind == "journal":
            return Path(self.target)
        if self.target.startswith("sqlite:///"):
            return Path(self.target[len("sqlite:///"):])
        return None

    def display(self) -> str:
        return self.target if self.kind == "journal" else safe_url(self.target)


def parse_storage(text: str | None, default_file: Path) -> StorageSpec:
    """None -> the default journal file; 'journal:PATH' or a path ending in .log -> journal; else a URL."""
    if text is None:
        return StorageSpec("journal", str(default_file))
    if text.startswith("journal:"):
        spec = StorageSpec("journal", text[len("journal:"):])
    elif "://" not in text and text.endswith(JOURNAL_SUFFIXES):
        spec = StorageSpec("journal", text)
    elif "://" not in text:
        raise PlannerError("--storage", text, "an Optuna RDB URL (sqlite:///x.db, postgresql://user@host/db) or a "
                           f"journal file ending in {', '.join(JOURNAL_SUFFIXES)}")
    else:
        spec = StorageSpec("rdb", text)
    file = spec.file
    # A storage is where trials outlive the command: an empty path (`sqlite:///`), a folder or SQLite's
    # in-memory database would open, run every trial and keep none of them.
    if file is not None and (not str(file).strip() or str(file) in (".", ":memory:") or file.name == ""
                             or file.is_dir()):
        raise PlannerError("--storage", text, "a file to keep the trials in, e.g. sqlite:///results/x.db or "
                           "results/x/journal.log (not a folder, nothing, or :memory:)")
    return spec


class _FlockLock:
    """optuna's journal lock interface over flock(2): released by the kernel when its holder dies (the
    symlink/open locks optuna ships wait a 30 s grace period after a killed holder)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        import os

        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        import os

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _journal_backend(path: Path) -> Any:
    """Optuna's JournalFileBackend, appending each record without fsync.

    A record is one write(2) of whole lines under the lock: once it returns, the bytes are in the kernel's
    page cache and survive the writer being killed (SIGKILL included); only a machine crash could lose the
    last records, which a search re-runs on resume. Optuna's backend fsyncs every record, which on this
    machine's disk costs more than the estimate (benchmarks/search_benchmark.py prints both)."""
    import json
    import os

    from optuna.storages.journal import JournalFileBackend
    from optuna.storages.journal._file import get_lock_file

    class Backend(JournalFileBackend):
        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
            with get_lock_file(self._lock):
                fd = os.open(self._file_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, text.encode("utf-8"))
                finally:
                    os.close(fd)

    return Backend(str(path), lock_obj=_journal_lock(path))


def _journal_lock(path: Path) -> Any:
    from optuna.storages.journal._file import BaseJournalFileLock

    class Lock(_FlockLock, BaseJournalFileLock):
        pass

    return Lock(path.with_name(path.name + ".lock"))


def open_storage(spec: StorageSpec) -> optuna.storages.BaseStorage:
    """An Optuna storage; errors (bad URL, server down, missing driver) name --storage."""

    if spec.kind == "journal":
        path = Path(spec.target)
        if not path.parent.is_dir():
            raise PlannerError("--storage", spec.target, "a journal file in an existing folder")
        from optuna.storages.journal import JournalStorage

        _check_journal_end(path)
        try:  # replays every record: a cut or foreign file fails here, before anything is written
            return JournalStorage(_journal_backend(path))
        except OSError:
            raise
        except Exception as exc:  # json's, Optuna's KeyError/ValueError on a record it cannot apply, bytes
            raise PlannerError(f"journal {path}", _first_line(exc), JOURNAL_DAMAGED) from None
    url = spec.target
    lock = spec.file.with_name(spec.file.name + ".study-lock") if spec.file is not None else None
    lock_existed = lock is not None and lock.exists()
    try:
        return _open_rdb(url, spec)
    except BaseException:
        if lock is not None and not lock_existed:  # ours, made for this attempt: leave no empty lock file
            with contextlib.suppress(OSError):
                lock.unlink()
        raise


JOURNAL_DAMAGED = ("an Optuna journal whose every line is a whole record (was it cut short or edited?); restore "
                   "it, or move it away to start the study afresh")


def _check_journal_end(path: Path) -> None:
    """A journal whose last record has no line end was cut (every record is written whole, in one write(2),
    by `_journal_backend`). Optuna would skip that line and append after it, welding the next record onto it
    and damaging the file for good; so refuse before anything is written. A writer of another worker may be
    mid-write: look twice, a moment apart."""
    for attempt in range(2):
        try:
            with path.open("rb") as f:
                if f.seek(0, 2) == 0:
                    return
                f.seek(-1, 2)
                if f.read(1) == b"\n":
                    return
        except FileNotFoundError:
            return
        if attempt == 0:
            time.sleep(0.2)
    raise PlannerError(f"journal {path}", "its last record has no line end", JOURNAL_DAMAGED)


def _first_line(exc: BaseException) -> str:
    """An exception as a short value for a one-line error."""
    text = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _open_rdb(url: str, spec: StorageSpec) -> Any:
    """Optuna's RDBStorage for `url`, retried while workers race to create its tables."""
    import optuna

    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with StudyLock.for_file(spec.file):  # SQLite: one creator at a time
                storage = optuna.storages.RDBStorage(url)
            break
        except Exception as exc:  # sqlalchemy raises many types; all mean "cannot use this URL (now)"
            # Workers starting together on a new database race to create Optuna's tables; the loser
            # succeeds on a retry, once the tables are there.
            if attempt + 1 < STORAGE_ATTEMPTS and any(m in str(exc).lower() for m in RACE_MARKERS):
                time.sleep(0.1 * (attempt + 1))
                continue
            raise PlannerError("--storage", safe_url(url), f"a reachable Optuna RDB URL ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200]})") from None
    if storage.engine.name == "sqlite":
        _sqlite_wal(storage.engine)
    return storage


def _sqlite_wal(engine: Any) -> None:
    """Write-ahead log + synchronous=NORMAL: one fsync per checkpoint instead of per trial, still
    crash-safe (a killed process loses nothing committed; https://sqlite.org/wal.html)."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    engine.dispose()  # connections opened by RDBStorage's setup reconnect with the pragmas


class StudyLock:
    """A lock shared by every worker of one storage (see the module docstring)."""

    def __init__(self, file: Path | None = None, engine: Any = None, key: str = ""):
        self.file = file
        self.engine = engine
        self.key = zlib.crc32(key.encode()) & 0x7FFFFFFF

    @classmethod
    def for_file(cls, file: Path | None) -> contextlib.AbstractContextManager[None]:
        return cls(file=file).hold() if file is not None and file.parent.is_dir() else contextlib.nullcontext()

    @classmethod
    def for_storage(cls, spec: StorageSpec, storage: Any, study: str) -> StudyLock:
        if spec.file is not None:
            return cls(file=spec.file, key=study)
        engine = getattr(storage, "engine", None)
        return cls(engine=engine if engine is not None and engine.name == "postgresql" else None, key=study)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.file is not None:
            # Not the journal's own write lock (".lock"): the storage takes that one while we hold this.
            lock = _FlockLock(self.file.with_name(self.file.name + ".study-lock"))
            lock.acquire()
            try:
                yield
            finally:
                lock.release()
        elif self.engine is not None:
            from sqlalchemy import text

            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
                    conn.commit()
        else:
            yield


def remove_if_empty(spec: StorageSpec, created: bool) -> None:
    """A search that failed before writing a trial leaves no empty storage file (nor its lock and folder)."""
    file = spec.file
    if not created or file is None or not file.exists():
        return
    try:
        storage = open_storage(spec)
        if any(storage.get_all_trials(s._study_id, deepcopy=False) for s in storage.get_all_studies()):
            return
        if hasattr(storage, "engine"):
            storage.engine.dispose()
    except Exception:  # unreadable: leave it for the user to look at
        return
    for suffix in ("", ".lock", ".study-lock", "-wal", "-shm"):
        p = file.with_name(file.name + suffix)
        p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        file.parent.rmdir()


def load_study(name: str, storage: str | None, journal: Path) -> tuple[Any, str]:
    """The stored study `name` and where it is stored, in words: the report reads a finished search through
    this, so only the search opens its storage. `storage` None means the journal file `journal`."""
    import optuna

    spec = parse_storage(storage, journal)
    store = open_storage(spec)
    names = optuna.study.get_all_study_names(store)
    if name not in names:
        raise PlannerError("--study", name, f"one of the searches in {spec.display()}: {', '.join(names) or 'none'}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=store), spec.display()


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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    if spec.kind == "rdb" and text.split("://")[0].split("+")[0] == "sqlite" and file is None:
        raise PlannerError("--storage", text, "an SQLite file to keep the trials in, sqlite:///PATH.db (sqlite:// "
                           "is a database in memory, gone when the search ends)")
    if file is not None and file.exists() and not file.is_dir() and not file.is_file():
        raise PlannerError("--storage", text, "a regular file to keep the trials in (not a device or a pipe)")
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

    def acquire(self, blocking: bool = True) -> bool:
        """Lock the file at `path`. `remove_if_free` may unlink it between our open and our flock: then the lock
        we got is on a file nobody else will open, so open the path again until the locked file is the one
        there (the usual pattern for removable lock files)."""
        import os

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)

    def remove_if_free(self) -> None:
        """Unlink the lock file when no process holds or waits on it, so that a finished search leaves no empty
        lock files beside its journal. Unlinked while held, so that a worker who opened it before sees (in
        `acquire`) that the path has moved on."""

        if not self.path.exists() or not self.acquire(blocking=False):
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.release()

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
            """Whole records or none: a full disk (ENOSPC), a file-size limit (EFBIG) or any other failed
            write cuts the file back to where this write began before the error goes up, so the journal
            stays resumable once space is freed (write(2) may write part of a buffer, then fail)."""
            data = memoryview(("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n")
                              .encode("utf-8"))
            with get_lock_file(self._lock):
                fd = os.open(self._file_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    start = os.fstat(fd).st_size  # the end: every writer appends under this lock
                    try:
                        while data:
                            data = data[os.write(fd, data):]
                    except BaseException:
                        os.ftruncate(fd, start)  # shrinking needs no space
                        raise
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

        check_journal(path)
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


class JournalRecord(BaseModel):
    """One line of an Optuna journal (optuna.storages.journal._storage: every record is a JSON object with
    an `op_code`, a JournalOperation 0-10, and the `worker_id` that wrote it)."""

    model_config = ConfigDict(extra="allow")
    op_code: int = Field(ge=0, le=10)
    worker_id: str


RECORD_START = b'{"op_code"'  # how `_journal_backend` and Optuna's json.dumps begin every record


def check_journal(path: Path) -> None:
    """Hold a journal to `JournalRecord` before Optuna replays it (or anything is appended to it), and repair
    a cut last record.

    Every record is written whole by `_journal_backend` (a failed write is cut back), but a journal written
    by an older planner, or cut by a machine crash, can end in part of a record. That part is dropped, under
    the journal's write lock (so no writer is mid-record), and said on stderr: the whole records before it
    are every finished trial, so the study resumes. Anything else that is not a whole record (a foreign or
    binary file, an edited line) is refused without touching the file."""
    import os
    import sys

    try:
        st = path.stat()
    except FileNotFoundError:
        return
    import stat

    if not stat.S_ISREG(st.st_mode):
        raise PlannerError("--storage", str(path), "a journal that is a regular file (not a device or a pipe)")
    lock = _journal_lock(path)
    existed = lock.path.exists()
    lock.acquire()
    try:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        _check_records(path, data[:end])
        tail = data[end:]
        if tail:
            if not tail.startswith(RECORD_START[: len(tail)]) or b"\x00" in tail:
                raise PlannerError(f"journal {path}", "its last line is not an Optuna record", JOURNAL_DAMAGED)
            with path.open("r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            sys.stderr.write(f"note: journal {path}: its last record was cut short ({len(tail)} bytes: a full "
                             "disk or a crash while writing); dropped it, every whole record kept\n")
    finally:
        lock.release()
        if not existed:
            lock.remove_if_free()


def _check_records(path: Path, data: bytes) -> None:
    import json

    if b"\x00" in data:
        raise PlannerError(f"journal {path}", "binary data", JOURNAL_DAMAGED)
    for number, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            JournalRecord.model_validate(json.loads(line))
        except (ValueError, ValidationError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            reason = _first_line(exc) if not isinstance(exc, ValidationError) else "not an Optuna record"
            raise PlannerError(f"journal {path}", f"line {number}: {reason[:80]}", JOURNAL_DAMAGED) from None


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


def release_locks(spec: StorageSpec) -> None:
    """Remove the lock files beside a journal or SQLite file that no other worker holds or waits on: a
    finished search leaves its trials, not empty `.lock` / `.study-lock` files."""
    if spec.file is None:
        return
    for suffix in (".lock", ".study-lock"):
        _FlockLock(spec.file.with_name(spec.file.name + suffix)).remove_if_free()


def _holds_trials(spec: StorageSpec) -> bool:
    """Whether the storage file holds a trial, read without Optuna (which writes on open: its tables, a
    migration) so that a full disk or a cut file can still be judged."""
    import json
    import sqlite3

    file = spec.file
    assert file is not None
    if spec.kind == "journal":
        with file.open("rb") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("op_code") == 4:  # JournalOperation.CREATE_TRIAL
                        return True
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{file}?mode=ro", uri=True)) as db:
            return bool(db.execute("SELECT count(*) FROM trials").fetchone()[0])
    except sqlite3.Error:  # no trials table yet (created in part), or not a database this search finished
        return False


def remove_if_empty(spec: StorageSpec, created: bool, folder_made: bool = True) -> None:
    """A search that failed before writing a trial leaves no storage file it made (nor its lock and folder):
    also when the disk filled while the file was being made (a partial SQLite database)."""
    file = spec.file
    if not created or file is None or not file.exists():
        release_locks(spec)
        return
    try:
        if _holds_trials(spec):
            release_locks(spec)
            return
    except OSError:  # unreadable: leave it for the user to look at
        return
    for suffix in ("", ".lock", ".study-lock", "-wal", "-shm"):
        p = file.with_name(file.name + suffix)
        p.unlink(missing_ok=True)
    if folder_made:  # the study folder the search made, not a folder the user named in --storage
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


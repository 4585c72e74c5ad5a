"""The one way the tool reads and writes files, so that every bad file is a one-line `PlannerError`.

Reading: a file may be missing, a folder, binary, not UTF-8, truncated, nested deeper than the parser's
recursion limit (100,000 `[` raise RecursionError in `json`), hold `NaN`/`Infinity` (Python's `json`
accepts them, JSON does not: RFC 8259 sec. 6), or have the wrong shape. Each case names the file.

Writing: the target folder may be read-only. Every write goes to a temporary file in the same folder and is
renamed over the target (`os.replace` is atomic on POSIX), so a failure leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from planner.errors import PlannerError

# Config files, caches and probe records are small; a bigger file is not one of ours (and would be slow).
# ASSUMPTION: 64 MiB, far above any Hugging Face config.json or probe record (a few KiB).
MAX_FILE_BYTES = 64 * 2**20
# mkstemp makes 0600 files; a written file gets the usual mode (0666 minus the umask) like open() would give.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def file_version(path: str | Path) -> tuple[str, int, int] | None:
    """(absolute path, mtime in ns, size) of what is at `path`, or None when nothing is: the key to cache a parsed
    file until it changes (prices, calibration: read on every estimate of a search)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # absent, or a path that cannot exist (a NUL, a file as a folder)
        return None
    # the absolute path, not the real one: resolving links costs a system call per folder, on every estimate
    return os.path.abspath(path), st.st_mtime_ns, st.st_size


def read_text(path: str | Path, what: str) -> str:
    """The file as UTF-8 text; a missing, unreadable, huge or binary file is a PlannerError naming `what`."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise PlannerError(what, str(p), f"a file of at most {MAX_FILE_BYTES // 2**20} MiB")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PlannerError(what, str(p), "an existing file") from None
    except IsADirectoryError:
        raise PlannerError(what, str(p), "a file, not a folder") from None
    except OSError as exc:
        raise PlannerError(what, str(p), f"a readable file ({exc.strerror or exc})") from None
    if b"\x00" in raw:
        raise PlannerError(what, str(p), "a text file (this one is binary)")
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not content
    except UnicodeDecodeError as exc:
        raise PlannerError(what, str(p), f"UTF-8 text (byte {exc.start} is not)") from None


def _none_constant(name: str) -> None:
    return None


def parse_json(text: str, what: str, source: str, *, nonfinite_as_none: bool = False) -> Any:
    """JSON with the strict grammar: no NaN/Infinity, bounded nesting; errors give line and column.

    `nonfinite_as_none` reads NaN/Infinity as null instead (for files our own probe writes with Python's
    `json`, where a diverged loss is NaN: no reading, rather than an unreadable file)."""
    try:
        return json.loads(text, parse_constant=_none_constant if nonfinite_as_none else _reject_constant)
    except json.JSONDecodeError as exc:
        raise PlannerError(what, source, f"valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:  # the NaN/Infinity constants
        raise PlannerError(what, source, f"valid JSON ({exc})") from None
    except RecursionError:
        raise PlannerError(what, source, "JSON nested at most a few hundred levels deep") from None


def read_json(path: str | Path, what: str, expect: type | None = dict, *, nonfinite_as_none: bool = False) -> Any:
    """Read and parse a JSON file; `expect` (dict or list) is the required top-level type."""
    data = parse_json(read_text(path, what), what, str(path), nonfinite_as_none=nonfinite_as_none)
    if expect is not None and not isinstance(data, expect):
        kind = {dict: "a JSON object", list: "a JSON list"}.get(expect, expect.__name__)
        raise PlannerError(what, str(path), f"{kind} at the top level, not {type(data).__name__}")
    return data


# Values a YAML document may stand for once its aliases are expanded. PyYAML shares an aliased object instead
# of copying it, so nine levels of nine aliases ("billion laughs") load at once, but any walk of the result
# (validation, an error message printing the value, a JSON dump) visits 9^9 values: minutes and a 15-million-
# character line. ASSUMPTION: a sweep holds tens of values; 100,000 leaves room for any hand-written file.
MAX_YAML_VALUES = 100_000


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """How many values `node` stands for with every alias expanded (a shared node counted at each use)."""
    import yaml

    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node that contains itself (a recursive alias) counts once more, not forever
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, MAX_YAML_VALUES + 1)
    return memo[id(node)]


def read_yaml(path: str | Path, what: str, expect: type | None = dict) -> Any:
    """Read and parse a YAML file (safe loader); the same checks as `read_json`, and at most
    MAX_YAML_VALUES values once aliases are expanded."""
    import yaml

    text = read_text(path, what)
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
                raise PlannerError(what, str(path), f"YAML of at most {MAX_YAML_VALUES:,} values with its aliases "
                                   "(&name / *name) expanded")
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise PlannerError(what, str(path), f"valid YAML ({where}{getattr(exc, 'problem', None) or exc})") from None
    except RecursionError:
        raise PlannerError(what, str(path), "YAML nested at most a few hundred levels deep") from None
    if expect is not None and not isinstance(data, expect):
        kind = {dict: "a mapping", list: "a list"}.get(expect, expect.__name__)
        raise PlannerError(what, str(path), f"{kind} at the top level, not {type(data).__name__}")
    return data


def read_parquet(path: str | Path, what: str) -> Any:
    """A Parquet table (pandas); a file that is not one (truncated, binary junk) names `what`."""
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except OSError as exc:
        raise PlannerError(what, str(path), f"a readable Parquet file ({exc.strerror or exc})") from None
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / ArrowException for bad bytes
        raise PlannerError(what, str(path), f"a Parquet file ({type(exc).__name__})") from None


def number(value: Any, field: str, *, low: float | None = None, high: float | None = None,
           integer: bool = False, low_open: bool = False) -> float:
    """`value` as a finite number in [low, high] (or (low, high] with `low_open`), else a PlannerError.

    Booleans and strings are not numbers here, even though Python would let `True + 1` through.
    """
    rng = _range_text(low, high, integer, low_open)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlannerError(field, value, rng)
    if isinstance(value, float) and not math.isfinite(value):
        raise PlannerError(field, value, rng)
    if integer and not float(value).is_integer():
        raise PlannerError(field, value, rng)
    if low is not None and (value <= low if low_open else value < low):
        raise PlannerError(field, value, rng)
    if high is not None and value > high:
        raise PlannerError(field, value, rng)
    return int(value) if integer else value


def _range_text(low: float | None, high: float | None, integer: bool, low_open: bool) -> str:
    kind = "an integer" if integer else "a finite number"

    def show(x: float) -> str:  # 274,877,906,944 rather than 2.74878e+11 where the bound is whole
        return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"

    if low is not None and high is not None:
        return f"{kind} {'>' if low_open else '>='} {show(low)} and <= {show(high)}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {show(low)}"
    if high is not None:
        return f"{kind} <= {show(high)}"
    return kind


def dumps_json(obj: Any, **kwargs: Any) -> str:
    """JSON text for stdout or a file; NaN or infinity anywhere is an error, never invalid JSON."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError as exc:
        raise PlannerError("--json", "a non-finite number", f"finite numbers only ({exc})") from None


@contextlib.contextmanager
def atomic_path(path: str | Path, what: str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed over `path`, on failure removed.

    An unwritable place (read-only folder, missing permission, full disk) is a PlannerError naming `what`.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
        os.close(fd)
    except OSError as exc:
        raise PlannerError(what, str(p), f"a writable place ({exc.strerror or exc})") from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, p)
    except OSError as exc:
        raise PlannerError(what, str(p), f"a writable place ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def writable_dir(path: str | Path, what: str) -> Path:
    """Create `path` if needed and check that a file can be made in it, before any slow work starts."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".planner-write-check.", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PlannerError(what, str(p), f"a writable folder ({exc.strerror or exc})") from None
    return p


def check_writable_dir(path: str | Path, what: str) -> Path:
    """Fail early, creating nothing, when `path` cannot become a writable folder: the nearest existing
    ancestor must be a folder we may write (a regular file in the way fails for every user, root included).

    Unlike `writable_dir` it leaves no empty folder behind when the command fails later."""
    p = Path(path)
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        why = "exists and is not a folder" if probe == p else f"{probe} is a file, not a folder"
        raise PlannerError(what, str(p), f"a writable folder ({why})")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise PlannerError(what, str(p), f"a writable folder ({probe} is read-only)")
    return p


def write_text(path: str | Path, text: str, what: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path, what) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, obj: Any, what: str, **kwargs: Any) -> Path:
    """Write `obj` as strict JSON to `path` atomically."""
    return write_text(path, dumps_json(obj, **kwargs) + "\n", what)

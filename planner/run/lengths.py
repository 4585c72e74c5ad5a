"""The run as input: what `--lengths` says, and the padded length of every step it makes.

Why: fine-tuning pads each batch to its longest sample (transformers' `DataCollatorWithPadding`), so the
step's shape changes every step, and the caching allocator keeps what earlier shapes made it reserve.

Two kinds of source:
- `uniform:MIN-MAX[:STEP]`: each step's padded length drawn uniformly from MIN, MIN+STEP, ..., MAX (what the
  issue's GPU runs did). Only padded lengths are known: real tokens = padded tokens, padding waste unknown.
- a file of per-sample token lengths (`.txt`, `.csv`, `.parquet`, `.npy`; a column named `length`, or the
  only column). Samples longer than `--seq-len` are truncated to it (the tokenizer's `truncation=True`).
  Batches of `batch_size` samples are made as a DataLoader with dynamic padding makes them:
  - `longest`: shuffled each epoch, each batch padded to its longest sample (`DataCollatorWithPadding`);
  - `bucketed`: `transformers.trainer_pt_utils.get_length_grouped_indices` (`group_by_length=True`):
    mega-batches of 50 batches, sorted by length inside, the mega-batch holding the longest sample first;
  - `max`: every batch padded to `--seq-len` (`padding="max_length"`): one shape;
  - `exact`: each value is one step's padded length, in file order (cycled when the run is longer): a run
    recorded elsewhere replayed as it was (benchmarks/run_readings.py replays the GPU readings' runs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from planner.errors import PlannerError

FLAG = "--lengths"
PADDINGS = ("longest", "bucketed", "max", "exact")
# transformers.trainer_pt_utils.get_length_grouped_indices: mega_batch_mult = min(len // (bs * 4), 50)
MEGA_BATCH_MULT = 50
MAX_TOKENS_PER_SAMPLE = 10**7  # above any model's positions: a bigger number is not a token length
MAX_SAMPLES = 10**8  # a length file of more samples is not one (and would not fit a search's budget)
MAX_RUN_STEPS = 100_000
_UNIFORM = re.compile(r"^uniform:(\d+)-(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class Lengths:
    """A parsed `--lengths`: uniform padded lengths, or per-sample lengths from a file."""

    text: str  # as given, for messages and JSON
    low: int = 0  # uniform: the range and its step
    high: int = 0
    step: int = 1
    samples: tuple[int, ...] = ()  # a file: per-sample token lengths, in file order (before truncation)

    @property
    def uniform(self) -> bool:
        return not self.samples

    @property
    def longest(self) -> int:
        return self.high if self.uniform else max(self.samples)


@dataclass(frozen=True)
class RunPlan:
    """Each step's padded length (one micro-batch of one GPU) and its real tokens (None: not known)."""

    padded: tuple[int, ...]
    real_tokens: tuple[int, ...] | None
    truncated_samples: int = 0  # samples of the file longer than --seq-len, truncated to it


def parse_lengths(text: str, flag: str = FLAG) -> Lengths:
    """`uniform:MIN-MAX[:STEP]` or the path of a length file; a bad one is a PlannerError naming `flag`."""
    if not isinstance(text, str) or not text.strip():
        raise PlannerError(flag, text, "uniform:MIN-MAX[:STEP] or a file of per-sample token lengths "
                                       "(.txt, .csv, .parquet, .npy)")
    text = text.strip()
    if text.startswith("uniform"):
        m = _UNIFORM.match(text)
        if m is None:
            raise PlannerError(flag, text, "uniform:MIN-MAX[:STEP] with integers, e.g. uniform:64-512:8")
        low, high, step = int(m[1]), int(m[2]), int(m[3] or 1)
        if not 1 <= low <= high <= MAX_TOKENS_PER_SAMPLE or not 1 <= step <= MAX_TOKENS_PER_SAMPLE:
            raise PlannerError(flag, text, f"1 <= MIN <= MAX <= {MAX_TOKENS_PER_SAMPLE:,} and STEP >= 1")
        return Lengths(text, low, high, step)
    return Lengths(text, samples=read_length_file(text, flag))


def read_length_file(path: str, flag: str = FLAG) -> tuple[int, ...]:
    """Per-sample token lengths from a file: integers >= 1; anything else names the file and what is wrong."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".txt", ".csv", ".parquet", ".npy"):
        raise PlannerError(flag, path, "uniform:MIN-MAX[:STEP] or a file ending in .txt, .csv, .parquet or .npy")
    if suffix == ".txt":
        values = _text_values(path, flag)
    elif suffix == ".csv":
        values = _csv_values(path, flag)
    elif suffix == ".parquet":
        from planner.io import read_parquet

        values = _column(read_parquet(path, flag), path, flag)
    else:
        values = _npy_values(path, flag)
    return _checked(values, path, flag)


def _text_values(path: str, flag: str) -> list:
    from planner.io import read_text

    return read_text(path, flag).split()


def _csv_values(path: str, flag: str) -> list:
    import csv
    import io

    from planner.io import read_text

    try:
        rows = [r for r in csv.reader(io.StringIO(read_text(path, flag))) if r and any(c.strip() for c in r)]
    except csv.Error as exc:
        raise PlannerError(flag, path, f"CSV text ({exc})") from None
    if not rows:
        raise PlannerError(flag, path, "at least one sample length (the file is empty)")
    head = [c.strip().lower() for c in rows[0]]
    if "length" in head:
        k = head.index("length")
        body = rows[1:]
    elif len(head) == 1:
        k = 0
        body = rows[1:] if not _is_int(rows[0][0]) else rows  # a header of another name, or none
    else:
        raise PlannerError(flag, path, f"a column named length, or only one column (found {', '.join(head)})")
    out = []
    for i, r in enumerate(body):
        if k >= len(r):
            raise PlannerError(flag, path, f"a length on every row (row {i + 2} has {len(r)} columns)")
        out.append(r[k])
    return out


def _is_int(cell: str) -> bool:
    try:
        int(cell.strip())
    except ValueError:
        return False
    return True


def _column(frame, path: str, flag: str) -> list:
    cols = [str(c) for c in frame.columns]
    if "length" in cols:
        series = frame["length"]
    elif len(cols) == 1:
        series = frame.iloc[:, 0]
    else:
        raise PlannerError(flag, path, f"a column named length, or only one column (found {', '.join(cols)})")
    return series.tolist()


def _npy_values(path: str, flag: str) -> list:
    import numpy as np

    from planner.io import MAX_FILE_BYTES

    p = Path(path)
    try:
        if p.stat().st_size > MAX_FILE_BYTES * 16:
            raise PlannerError(flag, path, f"a .npy file of at most {MAX_FILE_BYTES * 16 // 2**20} MiB")
        arr = np.load(p, allow_pickle=False)
    except FileNotFoundError:
        raise PlannerError(flag, path, "an existing file") from None
    except IsADirectoryError:
        raise PlannerError(flag, path, "a file, not a folder") from None
    except PlannerError:
        raise
    except Exception as exc:  # truncated, not a .npy, object arrays (pickles are refused)
        raise PlannerError(flag, path, f"a NumPy .npy array of integers ({type(exc).__name__})") from None
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        raise PlannerError(flag, path, f"a one-dimensional array of numbers (found {arr.dtype} of shape "
                                       f"{arr.shape})")
    return arr.tolist()


def _checked(values: list, path: str, flag: str) -> tuple[int, ...]:
    if not values:
        raise PlannerError(flag, path, "at least one sample length (the file is empty)")
    if len(values) > MAX_SAMPLES:
        raise PlannerError(flag, path, f"at most {MAX_SAMPLES:,} samples")
    out = []
    for i, v in enumerate(values):
        n = _as_length(v)
        if n is None:
            raise PlannerError(flag, path, f"token lengths, integers 1 to {MAX_TOKENS_PER_SAMPLE:,} (sample "
                                           f"{i + 1} is {str(v)[:20]!r})")
        out.append(n)
    return tuple(out)


def _as_length(v) -> int | None:
    """An integer length 1..MAX_TOKENS_PER_SAMPLE from a cell (str, int, float), or None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                return None
    try:
        if isinstance(v, float) and (not math.isfinite(v) or not v.is_integer()):
            return None
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if 1 <= n <= MAX_TOKENS_PER_SAMPLE else None


def check_against_seq_len(lengths: Lengths, seq_len: int, flag: str = FLAG) -> None:
    """`--seq-len` stays the maximum: uniform lengths above it are an error (a file's longer samples are
    truncated instead, as a tokenizer truncates them)."""
    if lengths.uniform and lengths.high > seq_len:
        raise PlannerError(flag, lengths.text, f"lengths up to --seq-len {seq_len}; raise --seq-len to "
                                               f"{lengths.high} or lower MAX")


def plan_steps(lengths: Lengths, *, batch_size: int, steps: int, seed: int, seq_len: int,
               padding: str = "longest") -> RunPlan:
    """The padded length of each of `steps` micro-batches of one GPU (and its real tokens, from a file)."""
    import numpy as np

    if padding not in PADDINGS:
        raise PlannerError("--padding", padding, PADDINGS)
    rng = np.random.default_rng(seed)
    if lengths.uniform:
        if padding == "max":
            return RunPlan(tuple([seq_len] * steps), None)
        choices = np.arange(lengths.low, lengths.high + 1, lengths.step)
        return RunPlan(tuple(rng.choice(choices, size=steps).tolist()), None)
    samples = np.minimum(np.asarray(lengths.samples, dtype=np.int64), seq_len)
    truncated = int((np.asarray(lengths.samples) > seq_len).sum())
    if padding == "exact":  # the file is the steps' padded lengths: real tokens unknown, as for uniform
        return RunPlan(tuple(np.resize(samples, steps).tolist()), None, truncated)
    padded: list[int] = []
    real: list[int] = []
    while len(padded) < steps:  # epoch after epoch, each drawn anew (a DataLoader reshuffles every epoch)
        for batch in _epoch_batches(samples, batch_size, padding, rng):
            real.append(int(batch.sum()))
            padded.append(seq_len if padding == "max" else int(batch.max()))
            if len(padded) == steps:
                break
    return RunPlan(tuple(padded), tuple(real), truncated)


def _epoch_batches(samples, batch_size: int, padding: str, rng):
    """One epoch's batches of sample lengths (the last one may be short: drop_last=False)."""
    order = rng.permutation(len(samples))
    if padding == "bucketed":
        order = _length_grouped(samples, order, batch_size)
    for i in range(0, len(order), batch_size):
        yield samples[order[i:i + batch_size]]


def _length_grouped(samples, order, batch_size: int):
    """`get_length_grouped_indices`: mega-batches of MEGA_BATCH_MULT batches (fewer for small data sets),
    each sorted by length, longest first; the mega-batch with the longest sample leads the epoch."""
    import numpy as np

    mult = min(len(order) // (batch_size * 4), MEGA_BATCH_MULT) or 1
    mega = batch_size * mult
    groups = [order[i:i + mega] for i in range(0, len(order), mega)]
    groups = [g[np.argsort(-samples[g], kind="stable")] for g in groups]
    lead = max(range(len(groups)), key=lambda k: samples[groups[k][0]])
    groups[0], groups[lead] = groups[lead], groups[0]
    return np.concatenate(groups)

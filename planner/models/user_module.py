"""Load the user's own model code: `--model path/to/file.py:build`, `--inputs file.py:batch`, `--loss file.py:fn`.

I/O edge: imports a Python file by path (no package needed) and checks what its functions return, turning
every failure into a one-line PlannerError naming the flag, the value and what is allowed (exit 2). The
functions run inside the tracer's FakeTensorMode (`planner.program.trace`), so `build` allocates nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from planner import caches
from planner.errors import PlannerError

# FILE.py:FUNCTION, the syntax of `--model`, `--inputs`, `--loss` and sweep `model:` / `inputs:` strings.
REFERENCE = re.compile(r"^(?P<file>.+\.py):(?P<fn>[A-Za-z_][A-Za-z0-9_]*)$")


def is_reference(value: object) -> bool:
    """Whether a --model value names user code (`file.py:function`) rather than a catalog model or config."""
    return isinstance(value, str) and REFERENCE.match(value) is not None


def refuse_inputs_unless_own(model: object, inputs: str | None, loss: str | None) -> None:
    """--inputs and --loss belong to a model of your own (`FILE.py:build`); the planner makes the batch and
    loss of a catalog model or a config.json itself, so either one given there would be silently unused."""
    if is_reference(model):
        return
    for flag, value in (("--inputs", inputs), ("--loss", loss)):
        if value is not None:
            raise PlannerError(flag, value, f"left out for --model {model}: only a model of your own "
                               "(--model FILE.py:build) takes it; the planner makes the batch and loss of "
                               "catalog models and config.json files itself")


# How long the user's code may run at one call (the file's import, build, batch, loss) before the command stops
# it with one line. Generous: building Llama-3-70B's modules on the meta device takes seconds; an endless loop
# is said within the 30 s the tool allows itself before saying why it waits. PLANNER_USER_CODE_TIMEOUT_S
# changes it (0: no limit).
USER_CODE_TIMEOUT_S = 25.0


def _timeout_s() -> float:
    import math
    import os

    text = os.environ.get("PLANNER_USER_CODE_TIMEOUT_S")
    if text is None:
        return USER_CODE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise PlannerError("PLANNER_USER_CODE_TIMEOUT_S", text, "seconds, a finite number >= 0 (0: no limit)")
    return value


class _TimeUp(BaseException):
    """Raised into the user's code by the timer (a BaseException, so their `except Exception` keeps going)."""


@contextlib.contextmanager
def user_code(flag: str, ref: str, what: str) -> Iterator[None]:
    """Run the user's code (`what`: "importing x.py", "build") under a time limit, with its exits caught.

    Why a timer signal in this process, not a thread or a subprocess: `build` must run here, inside the
    tracer's FakeTensorMode, and return the module the tracer walks. A subprocess cannot hand a module back,
    and a thread would build outside the mode (PyTorch keeps dispatch modes per thread: TorchDispatchModeTLS)
    and allocate real weights. SIGALRM interrupts Python code between bytecodes, which stops an endless
    Python loop; a single C call that never returns is not interruptible this way (the timer is left off
    outside the main thread, where signals cannot be handled)."""
    import signal
    import threading

    limit = _timeout_s()
    timed = limit > 0 and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    previous = None
    if timed:
        def ring(_signum: int, _frame: Any) -> None:
            raise _TimeUp

        previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    except _TimeUp:
        raise PlannerError(flag, ref, f"code that finishes: {what} ran for {limit:g} s and was stopped (an endless "
                           "loop? PLANNER_USER_CODE_TIMEOUT_S raises the limit)") from None
    except SystemExit as exc:
        raise PlannerError(flag, ref, f"code that returns: {what} called sys.exit({exc.code!r})") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def last_line(exc: BaseException) -> str:
    """The exception's last line, as Python prints it (`ValueError: bad width`)."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _import(path: Path, flag: str, ref: str) -> ModuleType:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"planner_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PlannerError(flag, ref, "a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with user_code(flag, ref, f"importing {path}"):
            spec.loader.exec_module(module)
    except PlannerError:
        del sys.modules[name]
        raise
    except Exception as exc:  # noqa: BLE001 - any error in user code becomes one line
        del sys.modules[name]
        hint = (f" (install {exc.name} in this Python)" if isinstance(exc, ModuleNotFoundError) and exc.name
                else "")
        raise PlannerError(flag, ref, f"importing {path} raised {last_line(exc)}{hint}") from None
    return module


def load_function(ref: str, flag: str) -> Callable[..., Any]:
    """The function named by `file.py:function`."""
    m = REFERENCE.match(ref)
    if m is None:
        raise PlannerError(flag, ref, "FILE.py:FUNCTION")
    path = Path(m["file"]).expanduser()
    if not path.is_file():
        raise PlannerError(flag, ref, f"file {path} does not exist")
    module = _import(path, flag, ref)
    fn = getattr(module, m["fn"], None)
    if not callable(fn):
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise PlannerError(flag, ref, f"{path} has no function {m['fn']!r}; it defines {', '.join(names) or 'none'}")
    return fn


def model_builder(ref: str, options: dict[str, Any] | None = None) -> Callable[[], Any]:
    """`build(**options)` checked to return an nn.Module; called by the tracer inside FakeTensorMode."""
    import torch

    fn = load_function(ref, "--model")

    def build() -> torch.nn.Module:
        try:
            with user_code("--model", ref, "build"):
                module = fn(**(options or {}))
        except PlannerError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PlannerError("--model", ref, f"build raised {last_line(exc)}") from None
        if not isinstance(module, torch.nn.Module):
            raise PlannerError("--model", ref, f"build must return a torch.nn.Module, got {type(module).__name__}")
        return module

    return build


def check_build(ref: str, options: dict[str, Any] | None = None) -> None:
    """Build the user's model once under FakeTensorMode (nothing allocated), so that a `build` that raises,
    exits or never returns fails before a search creates its study, not in every trial."""
    _checked_build(ref, json.dumps(options or {}, sort_keys=True, default=str), _file_version(ref))


def _file_version(ref: str) -> object:
    from planner.io import file_version

    m = REFERENCE.match(ref)
    return file_version(Path(m["file"]).expanduser()) if m else None


@caches.lru(16, scope="model", key="(reference, options JSON, the file's path, mtime and size)")
def _checked_build(ref: str, options_json: str, version: object) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model_builder(ref, json.loads(options_json))()


def _accepted(fn: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The model options `fn` names among its parameters (so `-o tab_in=200` reaches `batch(b, s, tab_in)`)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def batch_maker(ref: str, options: dict[str, Any] | None = None) -> Callable[[int, int], Any]:
    """`batch(batch_size, seq_len)` checked to return a dict of tensors (model(**batch)) or a tuple (model(*batch)).
    Model options that `batch` names as parameters are passed to it too."""
    import torch

    fn = load_function(ref, "--inputs")
    extra = _accepted(fn, options or {})

    def make(batch_size: int, seq_len: int) -> Any:
        try:
            with user_code("--inputs", ref, "batch"):
                batch = fn(batch_size, seq_len, **extra)
        except PlannerError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PlannerError("--inputs", ref, f"batch raised {last_line(exc)}") from None
        if isinstance(batch, dict):
            values = list(batch.values())
        elif isinstance(batch, (tuple, list)):
            values = list(batch)
        else:
            raise PlannerError("--inputs", ref, f"batch must return a dict of tensors or a tuple, got "
                               f"{type(batch).__name__}")
        if not values or not any(isinstance(v, torch.Tensor) for v in values):
            raise PlannerError("--inputs", ref, "batch must return at least one tensor")
        return batch

    return make


def loss_function(ref: str | None) -> Callable[[Any, Any], Any] | None:
    """`fn(output, batch)` returning the scalar loss, or None for the default (output.loss, else sum of the
    first tensor)."""
    if ref is None:
        return None
    import torch

    fn = load_function(ref, "--loss")

    def loss(output: Any, batch: Any) -> torch.Tensor:
        with user_code("--loss", ref, "loss"):
            value = fn(output, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise PlannerError("--loss", ref, "a function returning a scalar tensor")
        return value

    return loss


# Largest user source file a probe request carries (the request travels as JSON inside the job's source
# archive). ASSUMPTION: a model file is code, not data; 1 MiB is far above any hand-written module.
MAX_SHIPPED_SOURCE_BYTES = 1 << 20


def probe_model(ref: str, *, inputs: str | None, loss: str | None = None,
                options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a probe request carries for user code: the references and the source of each file they name.

    Why: the probe job runs on another machine (`jobs/probe.py`), which has none of the user's files; so the
    files travel inside the request (hence inside the job's source archive), keyed by their base name, and
    the job imports them from there. Each file is imported here first, so a bad reference fails now, as one
    line. One file per reference; a file that imports its own sibling modules must ship them itself.
    """
    if inputs is None:
        raise PlannerError("--inputs", None, f"give --inputs FILE.py:FUNCTION (a batch(batch_size, seq_len) "
                           f"function) for --model {ref}")
    files: dict[str, str] = {}
    refs: dict[str, str | None] = {}
    for flag, role, value in (("--model", "model", ref), ("--inputs", "inputs", inputs), ("--loss", "loss", loss)):
        if value is None:
            refs[role] = None
            continue
        load_function(value, flag)  # exists, imports, names a function: one-line errors here, not on the GPU
        m = REFERENCE.match(value)
        assert m is not None
        path = Path(m["file"]).expanduser()
        text = path.read_text(encoding="utf-8")
        if len(text.encode()) > MAX_SHIPPED_SOURCE_BYTES:
            raise PlannerError(flag, value, f"a source file of at most {MAX_SHIPPED_SOURCE_BYTES} bytes to ship "
                               "with the probe")
        if files.get(path.name, text) != text:
            raise PlannerError(flag, value, f"files with distinct base names (another {path.name} is shipped)")
        files[path.name] = text
        refs[role] = f"{path.name}:{m['fn']}"
    return {"name": refs["model"], "user_code": {**refs, "options": dict(options or {}), "files": files}}


def is_probe_model(model: object) -> bool:
    """A probe request's model block that holds user code (`probe_model`), not a ModelSpec."""
    return isinstance(model, dict) and isinstance(model.get("user_code"), dict)


def shipped_references(model: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The estimate arguments of a probe request's user code (`probe_model`), its files written under
    `folder/<hash>/`: so a probe record can be re-estimated (`planner validate`) where the user's files are not.
    Returns {"model": ref, "inputs": ref, "loss": ref or None, "model_options": {...}}."""
    code = model["user_code"]
    files: dict[str, str] = code["files"]
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    where = folder / digest
    where.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if Path(name).name != name:  # base names only, as probe_model writes them
            raise PlannerError("model_spec.user_code.files", name, "base file names")
        target = where / name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")

    def ref(value: str | None) -> str | None:
        return None if value is None else str(where / value)

    return {"model": ref(code["model"]), "inputs": ref(code["inputs"]), "loss": ref(code.get("loss")),
            "model_options": dict(code.get("options") or {})}

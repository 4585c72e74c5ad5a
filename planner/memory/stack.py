"""The software stack as an input: torch / CUDA / transformers versions and PYTORCH_CUDA_ALLOC_CONF.

What a stack decides, each from a sourced row of `planner/data/stacks.json`:

* the CUDA context: lazy module loading (CUDA >= 11.7 and torch >= 1.13, pytorch/pytorch PR #86509) loads
  only the kernels a run uses; eager loading before it loads every kernel of every library (>1 GB on V100);
* the attention kernel transformers picks by default for a model type (`sdpa` from the version whose model
  class sets `_supports_sdpa`, with torch >= 2.1.1; `eager` before);
* the cuBLAS / cuBLASLt workspaces of the torch version;
* whether `zero_grad()` frees the gradients between steps (set_to_none=True by default from torch 2.0) or
  keeps them allocated as zeros (before);
* the caching allocator's settings (`expandable_segments` and the other keys, validated).

The default stack is the AWS PyTorch DLC that `probe launch` would use for the GPU (planner/aws/images.py)
with the newest transformers (the probe job installs it, jobs/requirements.txt). Pure functions over the
table; the table is read once (I/O at the edge: `table()`).
"""

from __future__ import annotations

import re
from typing import Any

from planner import caches
from planner.alloc_conf import (  # noqa: F401  (re-exported: sw.table, sw.parse_version, ...)
    STACKS_PATH,
    Version,
    _check_alloc_value,
    _split_conf,
    fmt,
    parse_alloc_conf,
    parse_version,
    table,
)
from planner.errors import PlannerError
from planner.parallel import get as strategy_of
from planner.spec import GPU, SoftwareStack

MiB = 1 << 20
KiB = 1 << 10


def _closest(v: Version, known: list[Version]) -> Version:
    """The known version nearest to `v` in release order: the oldest / newest when outside the range, else the
    nearer neighbour of the same major (the older one on a tie)."""
    ks = sorted(known)
    if v <= ks[0]:
        return ks[0]
    if v >= ks[-1]:
        return ks[-1]
    older = max(k for k in ks if k <= v)
    newer = min(k for k in ks if k >= v)
    if older[0] != v[0]:
        return newer
    if newer[0] != v[0]:
        return older
    return older if v[1] - older[1] <= newer[1] - v[1] else newer


@caches.lru(1, scope="facts", key="none: stacks.json's torch rows")
def _torch_rows() -> dict[Version, dict[str, Any]]:
    return {parse_version("stacks.json torch", r["version"]): r for r in table()["torch"]}


def check_torch(value: str) -> str:
    """A torch version the table knows, as "X.Y"."""
    v = parse_version("--torch-version", value)
    rows = _torch_rows()
    if v not in rows:
        near = _closest(v, list(rows))
        raise PlannerError("--torch-version", value, f"a torch version the planner knows "
                           f"({fmt(min(rows))} to {fmt(max(rows))}); closest known: {fmt(near)}")
    return fmt(v)


def container_builds(torch: str) -> dict[Version, str]:
    """CUDA versions that NGC / AWS DLC containers pair with this torch (stacks.json ngc, dlc): {cuda: which}."""
    t = table()
    want = parse_version("torch", torch)
    out: dict[Version, str] = {}
    for kind, label in (("ngc", "NGC pytorch:{}-py3"), ("dlc", "AWS DLC pytorch-training:{}")):
        for tag, row in t.get(kind, {}).get("containers", {}).items():
            if parse_version("stacks.json torch", row["torch"]) == want:
                out[parse_version("stacks.json cuda", row["cuda"])] = label.format(tag)
    return out


def _pip_builds(torch: str) -> list[Version]:
    return [parse_version("stacks.json cuda", c) for c in _torch_rows()[parse_version("torch", torch)]["cuda"]]


def check_cuda(torch: str, value: str) -> str:
    """A CUDA version torch `torch` can run with: a pip build, a container's pair (NGC, AWS DLC), or any CUDA
    release of the same major as a listed build (see cuda_note); refused only when the pair cannot exist."""
    v = parse_version("--cuda-version", value)
    builds = _pip_builds(torch)
    if v in builds or v in container_builds(torch):
        return fmt(v)
    releases = [parse_version("stacks.json cuda", c) for c in table()["cuda_releases"]["versions"]]
    majors = {b[0] for b in builds} | {b[0] for b in container_builds(torch)}
    if v not in releases or v[0] not in majors:
        why = "no such CUDA release" if v not in releases else f"torch {torch} was built for CUDA " \
              f"{'/'.join(str(m) for m in sorted(majors))}.x only"
        raise PlannerError("--cuda-version", value, f"a CUDA build of torch {torch}: "
                           f"{', '.join(fmt(b) for b in builds)} (or a CUDA {'/'.join(str(m) for m in sorted(majors))}"
                           f".x release; {why}); closest known: {fmt(_closest(v, builds))}")
    return fmt(v)


def cuda_note(torch: str, cuda: str) -> str:
    """Why a torch/CUDA pair is accepted when pip never shipped it ("" for a pip build)."""
    v = parse_version("cuda", cuda)
    builds = _pip_builds(torch)
    if v in builds:
        return ""
    container = container_builds(torch).get(v)
    if container:
        return f"CUDA {cuda} for torch {torch}: the {container} build (stacks.json)"
    near = _closest(v, builds)
    return (f"CUDA {cuda} is not a listed build of torch {torch} ({', '.join(fmt(b) for b in builds)}); "
            f"behaviour of the nearest listed build, CUDA {fmt(near)}, assumed (a container or conda build)")


def known_transformers() -> list[Version]:
    known = table()["transformers"]["known"]
    return [(int(major), minor) for major, (lo, hi) in known.items() for minor in range(lo, hi + 1)]


def check_transformers(value: str) -> str:
    v = parse_version("--transformers-version", value)
    known = known_transformers()
    if v not in known:
        raise PlannerError("--transformers-version", value, f"a transformers version the planner knows "
                           f"({fmt(min(known))} to {fmt(max(known))}); closest known: {fmt(_closest(v, known))}")
    return fmt(v)


def check_arch(cuda: str, gpu: GPU, torch: str | None = None, flag: str = "--cuda-version") -> None:
    """A CUDA version that has kernels for the GPU (stacks.json cuda_arch): an H100 under CUDA 11.1 or a B200
    under CUDA 12.1 cannot run, as a K80 cannot under today's builds."""
    cc = ".".join(str(x) for x in gpu.compute_capability)
    row = next((r for r in table()["cuda_arch"]["rows"] if r["cc"] == cc), None)
    if row is None:
        return
    v = parse_version("--cuda-version", cuda)
    first, last = parse_version("cuda", row["first"]), row["last"] and parse_version("cuda", row["last"])
    if v >= first and (not last or v <= last):
        return
    span = f"CUDA {row['first']} or later" if not last else f"CUDA {row['first']} to {row['last']}"
    stack = f"torch {torch} with CUDA {cuda}" if torch else f"CUDA {cuda}"
    fix = "a newer --torch-version / --cuda-version" if v < first else "an older --cuda-version"
    raise PlannerError(flag, torch if flag == "--torch-version" else cuda,
                       f"{span} for {gpu.family} (compute capability {cc}): {stack} has no kernels for it "
                       f"(NVIDIA CUDA release notes); give {fix}")


# ---- the default stack and resolving the user's --------------------------------------------------


def default_stack(gpu: GPU) -> SoftwareStack:
    """The DLC `probe launch` picks for this GPU (the newest whose PyTorch has its kernels) + the newest
    transformers (jobs/requirements.txt installs it). Made once per GPU family and compute capability (every
    estimate asks; the stack is immutable)."""
    key = (gpu.family, tuple(gpu.compute_capability))
    hit = _DEFAULT_STACKS.get(key)
    if hit is None:
        hit = _DEFAULT_STACKS[key] = _default_stack(gpu)
    return hit


_DEFAULT_STACKS: dict[tuple, SoftwareStack] = caches.table("planner.memory.stack._DEFAULT_STACKS", scope="facts",
    key="(GPU family, compute capability) -> the default SoftwareStack")  # a few GPU families


def _default_stack(gpu: GPU) -> SoftwareStack:
    from planner.dlc import PYTORCH_TRAINING_IMAGES

    tf = table()["transformers"]["default"]
    cc = tuple(gpu.compute_capability)
    for img in PYTORCH_TRAINING_IMAGES:
        if img.supports(cc):  # type: ignore[arg-type]
            torch = fmt(parse_version("DLC", img.framework_version))
            digits = img.cuda.removeprefix("cu")
            cuda = f"{digits[:-1]}.{digits[-1]}"
            return SoftwareStack(torch=torch, cuda=cuda, transformers=tf, given=False,
                                 source=f"default: the AWS PyTorch DLC that `probe launch` uses for {gpu.family} "
                                        f"({img.tag}); transformers {tf}, the newest the probe job installs")
    last = table()["torch"][-1]
    return SoftwareStack(torch=last["version"], cuda=last["cuda"][-1], transformers=tf, given=False,
                         source="default: the newest torch the planner knows (no AWS DLC supports this GPU)")


def resolve_stack(stack: SoftwareStack | dict[str, Any] | None, gpu: GPU) -> SoftwareStack:
    """The user's stack (any subset of torch, cuda, transformers, alloc_conf), checked and completed from
    the default: a missing CUDA is the DLC's when torch matches it, else torch's newest build."""
    base = default_stack(gpu)
    if stack is None:
        return base
    if isinstance(stack, SoftwareStack):  # already resolved (e.g. Estimate.stack): check it, keep its flags
        check_cuda(check_torch(stack.torch), stack.cuda)
        check_arch(stack.cuda, gpu, stack.torch)
        check_transformers(stack.transformers)
        parse_alloc_conf(stack.alloc_conf, stack.torch)
        return stack
    given = stack.model_dump() if isinstance(stack, SoftwareStack) else dict(stack)
    unknown_keys = set(given) - set(SoftwareStack.model_fields)
    if unknown_keys:
        raise PlannerError("stack", sorted(unknown_keys)[0], ", ".join(("torch", "cuda", "transformers",
                                                                        "alloc_conf")))
    asked = {k: v for k, v in given.items() if k in ("torch", "cuda", "transformers", "alloc_conf") and v}
    if not asked:
        return base
    why = []
    torch = check_torch(asked["torch"]) if "torch" in asked else base.torch
    why.append(f"torch {torch} ({'given' if 'torch' in asked else 'DLC default'})")
    if "cuda" in asked:
        cuda = check_cuda(torch, asked["cuda"])
        why.append(f"CUDA {cuda} (given)")
        if cuda_note(torch, cuda):
            why.append(cuda_note(torch, cuda))
    elif torch == base.torch:
        cuda = base.cuda
        why.append(f"CUDA {cuda} (DLC default)")
    else:
        cuda = _torch_rows()[parse_version("torch", torch)]["cuda"][-1]
        why.append(f"CUDA {cuda} (newest build of torch {torch})")
    check_arch(cuda, gpu, torch, "--cuda-version" if "cuda" in asked else "--torch-version")
    tf = check_transformers(asked["transformers"]) if "transformers" in asked else base.transformers
    why.append(f"transformers {tf} ({'given' if 'transformers' in asked else 'default'})")
    conf = asked.get("alloc_conf", "")
    parse_alloc_conf(conf, torch)
    if conf:
        why.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}")
    return SoftwareStack(torch=torch, cuda=cuda, transformers=tf, alloc_conf=conf,
                         given=bool({"torch", "cuda"} & set(asked)), source="; ".join(why))


def describe(stack: SoftwareStack) -> str:
    conf = f", PYTORCH_CUDA_ALLOC_CONF={stack.alloc_conf}" if stack.alloc_conf else ""
    return f"torch {stack.torch}, CUDA {stack.cuda}, transformers {stack.transformers}{conf}"


# ---- what the stack decides -----------------------------------------------------------------------


def lazy_loading(stack: SoftwareStack) -> bool:
    """CUDA_MODULE_LOADING=LAZY by default: CUDA >= 11.7 and torch >= 1.13 (PR #86509)."""
    ml = table()["module_loading"]
    return (parse_version("cuda", stack.cuda) >= parse_version("cuda", ml["lazy_min_cuda"])
            and parse_version("torch", stack.torch) >= parse_version("torch", ml["lazy_min_torch"]))


def eager_context_mib(family: str) -> tuple[float, float, float]:
    """[low, point, high] MiB of an eager-loading context for this family (stacks.json eager_context_mib)."""
    ec = table()["eager_context_mib"]
    lo, point, hi = ec["families"].get(family, ec["default"])
    return float(lo), float(point), float(hi)


def default_attention(stack: SoftwareStack, family: str) -> str:
    """"sdpa" when transformers' model class for `family` supports SDPA in this version and torch has the SDPA
    transformers requires; else "eager" (stacks.json sdpa_default)."""
    sd = table()["sdpa_default"]
    row = sd["families"].get(family)
    if row is None:
        return "sdpa"
    if row["since"] is None:  # a model class that never enables SDPA (gpt-oss: its attention sinks)
        return "eager"
    tf_ok = parse_version("tf", stack.transformers) >= parse_version("tf", row["since"])
    torch_ok = parse_version("torch", stack.torch) >= parse_version("torch", sd["min_torch"])
    return "sdpa" if tf_ok and torch_ok else "eager"


def model_default_attention(stack: SoftwareStack, families: list[str]) -> str:
    """One kernel for the model: eager if any of its transformers would run eager (the larger memory)."""
    kinds = {default_attention(stack, f) for f in families}
    return "eager" if "eager" in kinds else "sdpa"


def zero_grad_keeps_gradients(stack: SoftwareStack, parallelism: str, optimizer_impl: str = "foreach") -> bool:
    """True when the training loop's `zero_grad()` leaves the gradient tensors allocated (filled with zeros)
    between steps: torch < 2.0, whose default was set_to_none=False (stacks.json zero_grad, PR #92731). Then
    the gradients are resident through the next forward and backward, as with gradient accumulation.
    Not for a "fused" optimizer before torch 2.0: that is apex's FusedAdam, whose zero_grad() sets them to
    None by default. ZeRO/FSDP keep their own gradient buffers: unchanged (ASSUMPTION, see stacks.json)."""
    if not strategy_of(parallelism).loop_zero_grad:
        return False
    zg = table()["zero_grad"]
    if parse_version("torch", stack.torch) >= parse_version("since", zg["set_to_none_since_torch"]):
        return False
    return not (optimizer_impl == "fused" and zg["apex_fused_sets_none"])


def workspace_rule(stack: SoftwareStack) -> dict[str, Any]:
    """The cuBLAS workspace row that applies to the stack's torch version."""
    v = parse_version("torch", stack.torch)
    rows = [r for r in table()["cublas_workspace"]["rules"] if parse_version("since", r["since"]) <= v]
    return rows[-1] if rows else table()["cublas_workspace"]["rules"][0]


def cublas_workspace_bytes(stack: SoftwareStack, compute_capability: tuple[int, int], handles: int) -> int:
    """handles x (cuBLAS workspace + cuBLASLt workspace) for this torch version and GPU."""
    r = workspace_rule(stack)
    cublas = r["cublas_sm90_kib"] if tuple(compute_capability) == (9, 0) else r["cublas_kib"]
    return handles * (cublas + r["cublaslt_kib"]) * KiB


def context_band(stack: SoftwareStack, family: str, lazy_bytes: int, *, overridden: bool = False,
                 calibrated: bool = False, calibrated_range: list[float] | None = None) -> tuple[int, int, int, str]:
    """(point, low, high, why) of the CUDA context for this stack on this GPU family, in bytes.

    Lazy loading: `lazy_bytes` (runtime.py's family figure, or the calibrated median) x the lazy band of
    stacks.json (narrower when calibrated; the measured [min, max] when the calibration file has it).
    Eager loading: the eager figures of stacks.json. A defaulted stack widens the high end."""
    t = table()
    if overridden:
        return lazy_bytes, lazy_bytes, lazy_bytes, "given with --cuda-context-mib (no band)"
    if lazy_loading(stack):
        why = (f"lazy module loading (CUDA {stack.cuda} >= {t['module_loading']['lazy_min_cuda']} and torch "
               f"{stack.torch} >= {t['module_loading']['lazy_min_torch']}: only the kernels used are loaded)")
        point = lazy_bytes
        if calibrated and calibrated_range:
            margin = t["lazy_context_band"]["calibrated_margin"]
            low, high = int(min(calibrated_range) * (1 - margin)), int(max(calibrated_range) * (1 + margin))
            why += f"; {family} calibrated (measured range ± {margin:.0%})"
        else:
            lo, hi = t["lazy_context_band"]["calibrated_relative" if calibrated else "relative"]
            low, high = int(point * lo), int(point * hi)
            why += f"; {family} {'calibrated' if calibrated else 'not calibrated'}"
    else:
        lo_mib, point_mib, hi_mib = eager_context_mib(family)
        point, low, high = int(point_mib * MiB), int(lo_mib * MiB), int(hi_mib * MiB)
        why = (f"eager module loading (CUDA {stack.cuda}, torch {stack.torch}: lazy loading needs CUDA >= "
               f"{t['module_loading']['lazy_min_cuda']} and torch >= {t['module_loading']['lazy_min_torch']}), "
               f"every kernel loaded at start: published {lo_mib / 1024:.1f}-{hi_mib / 1024:.1f} GiB")
    if not stack.given:
        high = int(high * t["defaulted_stack_widening"]["factor"])
        why += "; stack not given (DLC default assumed)"
    return point, min(low, point), max(high, point), why


NGC_TAG = re.compile(r"pytorch:(\d\d\.\d\d)-py3")


def ngc_stack(text: str) -> dict[str, str] | None:
    """{"torch", "cuda"} of the NGC PyTorch container named in `text` ("NGC pytorch:20.06-py3"), if known."""
    m = NGC_TAG.search(text or "")
    row = table()["ngc"]["containers"].get(m.group(1)) if m else None
    return {"torch": row["torch"], "cuda": row["cuda"]} if row else None

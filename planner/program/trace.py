"""Trace one training step of any `nn.Module` on CPU fake tensors and record it as plain data.

Why: the analytic core knows six hand-modelled families; users train their own modules. Under
`FakeTensorMode` a CPU build runs forward, loss, backward and an optimizer step without allocating memory
(so Llama-8B dimensions trace on a laptop), and a `TorchDispatchMode` underneath sees every ATen op. We
record, in order:

- each op (`OpRecord`: name, phase, running module, input/output shapes and dtypes) for the roofline;
- each storage allocated and freed (`StorageEvent`, CUDA-mapped bytes and dtype, a category) for the
  allocator replay; a storage is new when an op output's storage was not live before, freed when it dies
  (its Python object's weak-reference callback says so; the free is recorded after the op that follows, as
  a scan of every live storage after every op would, `_Recorder.scan`);
- each storage autograd saves for backward (`SavedRecord`, via `saved_tensors_hooks`), attributed to the
  top-level child module running when it was saved (the "block"), or "loss" after the model returned.

CPU → CUDA: ops are mapped through `planner.program.cuda` (dropout masks, norm statistics, host RNG state,
the SDPA kernel CUDA would pick, 512-byte rounding). Same exclusions as `MemoryBytes.activations`: parameter,
buffer and input-batch storages are not activations.

Modelled on `torch/utils/flop_counter.py` (a dispatch mode with a per-op registry) and the saved-tensor
measurement in `tests/saved_tensors.py`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner import caches
from planner.errors import PlannerError
from planner.program import cuda, forked
from planner.program.records import (  # noqa: F401 - the records are read from here too
    LOSS_BLOCK,
    ROOT_BLOCK,
    OpRecord,
    SavedRecord,
    StepTrace,
    StorageEvent,
    TensorMeta,
    TracedBlock,
    _block_order,
    block_memory,
)
from planner.spec import Backend, TrainConfig

AUTOCAST_DTYPE = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
MODEL_DTYPE = {"fp32": torch.float32, "amp-bf16": torch.float32, "amp-fp16": torch.float32,
               "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------- helpers


# dtype -> its name, one string object each (torch's dtypes are a fixed set): not a cache of derived facts
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32; one string object per dtype, so that the records share it (`_DTYPE_NAMES`)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def storage_key(t: torch.Tensor) -> int:
    """The storage's C++ address (what `StorageWeakRef(storage).cdata` holds; read without making and
    freeing a weak reference per call, which the tracer did twice per op)."""
    return t.untyped_storage()._cdata


def _tensors(tree: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among an ATen op's arguments or results, in `tree_flatten`'s order (tuples and lists in
    order, dicts by insertion; ATen passes no other containers): the pytree walk, without its per-node
    registry look-ups (a tenth of a trace's time went to flattening)."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _tensors(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, out)
    return out


def _metas_of(tensors: list[torch.Tensor], memo: dict | None = None) -> tuple[TensorMeta, ...]:
    """`memo` (the recorder's): equal metadata tuples as one object, so the trace cache finds them shared."""
    names = _DTYPE_NAMES
    out = tuple(TensorMeta(tuple(t.shape), names.get(t.dtype) or names.setdefault(t.dtype, dtype_name(t.dtype)))
                for t in tensors)
    return out if memo is None else memo.setdefault(out, out)


def _metas(tree: Any) -> tuple[TensorMeta, ...]:
    return _metas_of(_tensors(tree, []))


@dataclass
class _StorageInfo:
    sid: int
    ref: StorageWeakRef
    numel: int
    dtype: str
    device: cuda.Storage
    block: str
    category: str = "temporary"
    watch: weakref.ref | None = None  # on the storage's Python object: its callback reports the death


class _Recorder(TorchDispatchMode):
    """Sees every ATen op under FakeTensorMode; keeps the storage table and the op list.

    Frees: a temporary storage's death is reported by a weak-reference callback on its Python object
    (`torch.UntypedStorage` objects are kept alive by their C++ storage, so the object dies with the storage)
    and recorded after the op that follows, in registration order: exactly the events of `scan=True`, which
    checks every live temporary's weak reference after every op (49,600 ops × ~170 live storages = 8.5
    million checks for T5-base at 16 x 512, a third of the trace's time; kept as the reference the tests
    compare against). A callback whose storage is in fact still alive (a Python object that died without
    its storage) moves that storage to the scanned set, so the events stay those of the scan."""

    def __init__(self, backend: Backend, stack: list[str], *, scan: bool = False):
        super().__init__()
        self.backend = backend
        self.stack = stack
        self.scan = scan
        self.dead: list[int] = []  # storage keys whose Python object died since the last op
        self.scanned: dict[int, _StorageInfo] = {}  # key -> info: storages whose Python object died before them
        self.phase = "forward"
        self.backward_block = ""
        self.ops: list[OpRecord] = []
        self.storages: dict[int, _StorageInfo] = {}  # sid -> info
        self.live: dict[int, _StorageInfo] = {}  # storage key -> info, not expired
        self.polled: dict[int, _StorageInfo] = {}  # key -> info: live storages that may be freed
        self.raw_events: list[tuple[int, str, int]] = []  # (op, action, sid)
        # per event: 0 an op's result, 1 a free, 2 another allocation (autograd's saving, before the step); and
        # whether a free's storage died before the op it is recorded after began (between two ops): where
        # planner.program.periodic places an event among the layers, not what the trace records
        self.event_stage: list[int] = []
        self.event_late: list[bool] = []
        self.before = 0  # deaths reported before the op now dispatching began
        self.op_block: list[str] = []
        self.failed_in: list[str] | None = None  # the module stack when an op raised
        self.repeats: dict[str, int] | None = None  # `layer_repeats` of the traced module
        self.metas: dict[tuple, tuple] = {}  # an op's metadata tuple -> the equal one first seen (`_metas_of`)

    def block(self) -> str:
        if self.phase != "forward":
            return self.backward_block
        return block_of(self.stack[-1], self.repeats) if self.stack else LOSS_BLOCK

    def register(self, t: torch.Tensor, category: str, op: int = -1, stage: int = 2) -> _StorageInfo:
        """A storage that exists before the step (parameter, buffer, batch) or a new one."""
        key = storage_key(t)
        info = self.live.get(key)
        if info is not None and not info.ref.expired():
            return info
        st = t.untyped_storage()
        itemsize = t.element_size()
        numel = st.nbytes() // itemsize
        info = _StorageInfo(len(self.storages), StorageWeakRef(st), numel, dtype_name(t.dtype),
                            cuda.Storage(numel, dtype_name(t.dtype)), self.block(), category)
        self.storages[info.sid] = info
        self.live[key] = info
        if category == "temporary":
            self.polled[key] = info
            if not self.scan:
                dead = self.dead
                info.watch = weakref.ref(st, lambda _, key=key: dead.append(key))
        self.raw_events.append((op, "alloc", info.sid))
        self.event_stage.append(stage)
        self.event_late.append(False)
        return info

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "prim":  # metadata queries (`x.device`): no tensor, no kernel
            return func(*args, **(kwargs or {}))
        self.before = len(self.dead)
        try:
            out = func(*args, **(kwargs or {}))
        except Exception:
            # where it failed, for the one-line error (the module stack unwinds as the exception leaves)
            self.failed_in = list(self.stack)
            raise
        index = len(self.ops)
        name, kernel, formula = _op_facts(func)
        results = _tensors(out, [])
        flops = _flops(formula, args, kwargs, out) if formula is not None else 0
        self.ops.append(OpRecord(index, name, self.phase, self.stack[-1] if self.stack else "",
                                 _metas_of(_tensors(kwargs, _tensors(args, [])), self.metas),
                                 _metas_of(results, self.metas), flops,
                                 kernel))
        self.op_block.append(self.block())
        for i, t in enumerate(results):
            key = storage_key(t)
            info = self.live.get(key)
            if info is None or info.ref.expired():
                info = self.register(t, "temporary", index, 0)
            mapped = cuda.device_storage(name, i, info.numel, info.dtype, self.backend)
            if mapped.rule or mapped.host:  # e.g. bernoulli_ turns a fresh buffer into dropout noise
                info.device = mapped
        self._poll(index)
        return out

    def _poll(self, index: int) -> None:
        """Free events, after op `index`, for the temporaries that died since the previous op."""
        if self.scan:
            self._scan(index)
            return
        if not self.dead and not self.scanned:
            return
        expired = _EXPIRED
        gone: list[tuple[int, int, bool]] = []  # (sid, key, died before the op began)
        for i, key in enumerate(self.dead):
            info = self.polled.get(key)
            if info is None or key in self.scanned:
                continue
            if expired(info.ref.cdata):
                gone.append((info.sid, key, i < self.before))
            else:  # the Python object died, the storage lives: watch it by scanning
                self.scanned[key] = info
        self.dead.clear()
        self.before = 0
        for key, info in list(self.scanned.items()):
            if expired(info.ref.cdata):
                del self.scanned[key]
                gone.append((info.sid, key, False))
        gone.sort()  # registration order, as the scan walks `polled`
        for sid, key, late in gone:
            info = self.polled.pop(key)
            if self.live.get(key) is info:
                del self.live[key]
            self.raw_events.append((index, "free", sid))
            self.event_stage.append(1)
            self.event_late.append(late)

    def _scan(self, index: int) -> None:
        """The reference poller: free events for storages whose weak reference expired, checking every live
        temporary (the C check, without the Python wrapper)."""
        expired = _EXPIRED
        gone = [key for key, info in self.polled.items() if expired(info.ref.cdata)]
        for key in gone:
            info = self.polled.pop(key)
            if self.live.get(key) is info:
                del self.live[key]
            self.raw_events.append((index, "free", info.sid))
            self.event_stage.append(1)
            self.event_late.append(False)


_EXPIRED = torch.UntypedStorage._expired  # what StorageWeakRef.expired calls (torch/storage.py)

# Ops that launch no CUDA kernel beyond views (`OpOverload.is_view`) and metadata queries (`prim::device`,
# which fake tensors dispatch): uninitialised allocations, autograd metadata, scalar reads (a sync, not a
# kernel) and aliasing reshapes.
_NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.detach.default", "aten.lift_fresh.default", "aten.alias.default",
    "aten._local_scalar_dense.default", "aten._unsafe_view.default", "aten._reshape_alias.default",
    "aten.set_.source_Storage_storage_offset", "aten.resize_.default", "aten.sym_size.int",
    "aten.sym_stride.int", "aten.sym_numel.default", "aten.is_same_size.default",
})


# func -> (the op's name as recorded, whether it launches a kernel, its FLOP formula or None): the same for
# every call of an op, so worked out once per op rather than once per call
_OP_FACTS: dict[Any, tuple[str, bool, Any]] = {}


def _op_facts(func: Any) -> tuple[str, bool, Any]:
    facts = _OP_FACTS.get(func)
    if facts is None:
        from torch.utils.flop_counter import flop_registry

        name = str(func.name()) if hasattr(func, "name") else str(func)
        name = f"aten.{name.removeprefix('aten::')}" if "::" in name else name
        name = name if "." in name.split("aten.", 1)[-1] else f"{name}.default"
        kernel = not (getattr(func, "is_view", False) or name in _NO_KERNEL or "prim::" in name)
        facts = _OP_FACTS[func] = (name, kernel, flop_registry.get(getattr(func, "_overloadpacket", None)))
    return facts


def _flops(formula: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op by its `torch.utils.flop_counter.flop_registry` formula (what FlopCounterMode counts:
    matmuls, convolutions and attention, forward and backward); 0 for the rest."""
    try:
        return int(formula(*args, **(kwargs or {}), out_val=out))
    except Exception:  # noqa: BLE001 - a formula that rejects these arguments: count nothing, as for other ops
        return 0


def component_of(qualname: str) -> str:
    """The top-level child a parameter or module belongs to (`Estimate.parameters` keys)."""
    return qualname.split(".", 1)[0] if qualname else ROOT_BLOCK


def block_of(qualname: str, repeats: dict[str, int] | None = None) -> str:
    """The block a module belongs to: the path through one of its numbered children (an entry of a ModuleList
    or nn.Sequential: a transformer layer), else its top-level child ("" = the root's own forward). Layer-sized
    blocks let the step memory free activations and grow gradients layer by layer, as the analytic core does.

    Which numbered child: the one repeated most (`repeats`: same-class siblings of each numbered module, from
    `layer_repeats`), the outermost on a tie; so `TextBertBase.0.encoder.layer.3` (a wrapper's child "0"
    around 12 identical layers) is layer 3, and `layers.3.mlp.0` is layer 3. Without `repeats`, the first."""
    if not qualname:
        return ROOT_BLOCK
    parts = qualname.split(".")
    best, most = -1, 0
    for i, part in enumerate(parts):
        if part.isdigit():
            n = repeats.get(".".join(parts[: i + 1]), 1) if repeats is not None else 1
            if best < 0 or n > most:
                best, most = i, n
    return ".".join(parts[: best + 1]) if best >= 0 else parts[0]


def layer_repeats(module: torch.nn.Module) -> dict[str, int]:
    """For each numbered child (`layers.3`): how many numbered siblings share its class."""
    by_parent: dict[tuple[str, type], list[str]] = {}
    for name, child in module.named_modules():
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            by_parent.setdefault((parent, type(child)), []).append(name)
    return {name: len(names) for names in by_parent.values() for name in names}


@contextlib.contextmanager
def _module_stack(module: torch.nn.Module, names: dict[int, str] | None = None) -> Iterator[list[str]]:
    """Qualified names of the modules running now (global forward hooks, as tests/saved_tensors.py); `names`:
    id -> name, taken before layers were cut out (`planner.program.periodic`)."""
    names = names if names is not None else {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []

    def pre(mod, args):
        stack.append(names.get(id(mod), stack[-1] if stack else ""))

    def post(mod, args, out):
        if stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    # always_call: non-reentrant checkpointing stops a recomputation early by raising inside the module's
    # forward (torch/utils/checkpoint.py, _StopRecomputationError); the stack must still unwind.
    h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield stack
    finally:
        h1.remove()
        h2.remove()


# ------------------------------------------------------------------------------------------- SDPA


@contextlib.contextmanager
def _cuda_sdpa(attention: str, flash_ok: bool) -> Iterator[None]:
    """Runs `F.scaled_dot_product_attention` as the kernel CUDA would pick (`cuda.sdpa_kernel`): the fused
    kernels' ATen ops have meta implementations, so fake tensors run them and autograd saves exactly what
    their CUDA backward needs (q, k, v, output, logsumexp, bias).

    The function is swapped on `torch.nn.functional` for the duration of the trace (a TorchFunctionMode is
    not active while non-reentrant checkpointing recomputes in backward); code that imported the function
    by name before the trace keeps the CPU kernel."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        return cuda_sdpa(*args, attention=attention, flash_ok=flash_ok, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _cuda_autocast_fp32() -> Iterator[None]:
    """CPU autocast runs the matmuls in 16-bit like CUDA, but keeps softmax, log_softmax, layer_norm, pow and
    rsqrt in 16-bit where CUDA autocast runs them in fp32 (`cuda.autocast_fp32_op`). While AMP is on, these
    functions cast 16-bit floating inputs to fp32 first, as CUDA's autocast does (the cast is recorded by
    autograd, so the saved tensors are fp32). Swapped on the modules for the trace's duration, so they hold
    in checkpoint recomputation too. softmax and log_softmax given an explicit dtype keep it (autocast's
    fp32_set_opt_dtype policy). The reverse for cross-entropy: CPU autocast casts the whole loss to fp32,
    CUDA runs ATen's composite (`cuda_cross_entropy`)."""
    import importlib

    import torch.nn.functional as F

    patched = [(F, "cross_entropy", F.cross_entropy)]
    F.cross_entropy = cuda_cross_entropy(F.cross_entropy)
    for owner_name, attr, op in cuda.AUTOCAST_FP32_FUNCTIONS:
        if not cuda.autocast_fp32_op(op, "cuda") or cuda.autocast_fp32_op(op, "cpu"):
            continue
        owner = torch.Tensor if owner_name == "torch.Tensor" else importlib.import_module(owner_name)
        original = getattr(owner, attr)
        patched.append((owner, attr, original))
        setattr(owner, attr, _fp32_under_autocast(original, keeps_dtype=op in cuda.SET_OPT_DTYPE_OPS))
    try:
        yield
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def _fp32_under_autocast(fn: Callable[..., Any], keeps_dtype: bool = False) -> Callable[..., Any]:
    low = (torch.float16, torch.bfloat16)

    def up(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_autocast_enabled("cpu"):
            return fn(*args, **kwargs)
        if keeps_dtype and (kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)):
            with torch.autocast("cpu", enabled=False):  # fp32_set_opt_dtype: an explicit dtype is kept
                return fn(*args, **kwargs)
        args = tuple(up(a) for a in args)
        kwargs = {k: up(v) for k, v in kwargs.items()}
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def cuda_cross_entropy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`F.cross_entropy` as CUDA autocast runs it, for a trace under CPU autocast. CPU autocast has
    cross_entropy_loss on its fp32 list (one fp32 copy of the logits, an fp32 log-softmax saved); CUDA's has
    not, so ATen's composite runs (aten/src/ATen/native/LossNLL.cpp `cross_entropy_loss`): log_softmax in the
    logits' own dtype (explicit, kept by fp32_set_opt_dtype) and nll_loss, on CUDA's and CPU's fp32 lists alike,
    on an fp32 copy it saves (`activations.cross_entropy_saved`). Class-index targets without label smoothing
    (what transformers' heads pass); anything else keeps CPU's whole-loss cast (DIFFERENCE, stated: the label
    smoothing and probability-target composites are not emulated)."""
    import torch.nn.functional as F

    low = (torch.float16, torch.bfloat16)

    def wrapper(input: torch.Tensor, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                label_smoothing: float = 0.0) -> torch.Tensor:
        if (not torch.is_autocast_enabled("cpu") or not isinstance(input, torch.Tensor) or input.dtype not in low
                or label_smoothing != 0.0 or target.is_floating_point() or size_average is not None
                or reduce is not None):
            return fn(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        with torch.autocast("cpu", enabled=False):
            log_probs = torch.log_softmax(input, 0 if input.dim() == 1 else 1, dtype=input.dtype)
        return F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)

    return wrapper


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive bias SDPA makes of it (attention.cpp `convert_boolean_attn_mask`): one
    `where` between two 0-dim tensors of the query's dtype, so one kernel writing the bias in that dtype (what
    torch 2.13 dispatches on the CPU, whose SDPA calls the same function; tests/test_sdpa_mask.py). The tracer
    had written it as logical_not, a `where` into fp32 and a cast: two more kernels and an fp32 b·s² transient
    per attention call."""
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(float("-inf"), dtype=dtype))


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              attention: str, flash_ok: bool):
    """SDPA through the CUDA kernel's own op. Bool masks become an additive bias in the query dtype
    (attention.cpp `convert_boolean_attn_mask`); the memory-efficient kernel pads its last dim to 8
    (`preprocess_mask`, EFFICIENT_BIAS_ALIGN). A mask that requires grad runs the math composite
    (`cuda.sdpa_kernel`), which saves fp32 s² probabilities per call."""
    from planner.memory.activations import EFFICIENT_BIAS_ALIGN

    if torch.is_autocast_enabled("cpu"):
        # SDPA is on CUDA autocast's lower-precision list: every floating input, the mask included, is cast
        # (autocast_mode.cpp); the kernel ops below are on no CPU autocast list, so cast here.
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(low) if x.is_floating_point() else x for x in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
        with torch.autocast("cpu", enabled=False):
            return cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             attention=attention, flash_ok=flash_ok)
    if key.shape[-3] != query.shape[-3]:  # GQA: SDPA's math path repeats k/v heads
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    kernel = cuda.sdpa_kernel("cuda", attention, flash_ok, dtype_name(query.dtype), dropout_p,
                              attn_mask is not None, query.shape[-1],
                              attn_mask is not None and attn_mask.requires_grad)
    if kernel == "math":
        # the composite ATen runs on both devices (it upcasts 16-bit inputs itself: cuda.sdpa_math_dtype);
        # bool masks are converted first, as attention.cpp does before calling it
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = additive_mask(attn_mask, query.dtype)
        return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p,
                                                                 is_causal, scale=scale)[0]
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  False, scale=scale)[0]
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = additive_mask(bias, query.dtype)
        last = bias.shape[-1]
        if last % EFFICIENT_BIAS_ALIGN:
            pad = EFFICIENT_BIAS_ALIGN - last % EFFICIENT_BIAS_ALIGN
            bias = torch.nn.functional.pad(bias, (0, pad))[..., :last]
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                  is_causal, scale=scale)[0]


# ------------------------------------------------------------------------------------------- trace


def default_loss(output: Any) -> torch.Tensor:
    """`output.loss` when present, else the sum of the first tensor in the output."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves, _ = tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())
    first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if first is None:
        raise PlannerError("--loss", None, "the model output has no floating-point tensor; give --loss FILE.py:FN")
    return first.sum()


def _call(module: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(batch)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _to_model_dtype(batch: Any, dtype: torch.dtype) -> Any:
    """Pure 16-bit training feeds floating inputs in the model's dtype (`batch = batch.half()`)."""
    if dtype == torch.float32:
        return batch
    if isinstance(batch, dict):
        return {k: _to_model_dtype(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_model_dtype(v, dtype) for v in batch)
    if isinstance(batch, torch.Tensor) and batch.is_floating_point():
        return batch.to(dtype)
    return batch


def _optimizer(params: list[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer | None:
    """The torch optimizer of `config` (foreach / fused / for-loop as chosen); None where torch has none."""
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    kw = impl[config.optimizer_impl]
    if config.optimizer in ("adam", "adamw"):
        cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, **kw)
    if config.optimizer in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if config.optimizer == "sgd-momentum" else 0.0, **kw)
    return None


def _step_optimizer(params: list[torch.nn.Parameter], config: TrainConfig, rec: _Recorder) -> bool:
    """Run `config`'s optimizer step once and register the states it made with `rec`; False where torch has no
    such optimizer. One piece for the trace and for the optimizer step traced alone (`optimizer_step`), so the
    step spliced into a trace is made exactly as the step run inside it."""
    opt = _optimizer(params, config)
    if opt is None:
        return False
    opt.step()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                rec.register(v, "optimizer_state").category = "optimizer_state"
    return True


def _fake_error(exc: Exception, stack: list[str], source: str, root: str) -> PlannerError:
    op = getattr(exc, "func", None)
    where = (stack[-1] or f"(root {root})") if stack else f"(after the forward of {root})"
    return PlannerError("--model", source,
                        f"op {op or type(exc).__name__} cannot run on fake tensors in module {where!r} "
                        "(data-dependent control flow, e.g. .item(), nonzero, a Python branch on a tensor "
                        "value); make the shape-changing step independent of tensor values")


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback when a meta kernel rejects the user's shapes; the planner reports that
    error as one line itself."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


# What torch says when code under FakeTensorMode reads a tensor's data pointer (transformers' tied-weight and
# safetensors checks do; torch/_subclasses/fake_tensor.py, `_set_warn_deprecated_on_mutable_data_ptr`): the
# pointer is meaningless for a fake tensor and the trace does not use it, so the warning is noise to a user.
FAKE_DATA_PTR_WARNING = "Accessing the data pointer of FakeTensor is deprecated"


def trace_step(build: Callable[[], torch.nn.Module], make_batch: Callable[[int, int], Any], config: TrainConfig,
               *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, backend: Backend = "cuda",
               flash_ok: bool = True, name: str = "model", source: str = "",
               enable_checkpointing: Callable[[torch.nn.Module], None] | None = None,
               scan_frees: bool = False, periodic: bool = True, before_key: Any = None) -> StepTrace:
    """`_trace_step` without torch's FakeTensor data-pointer warning in the user's output.

    `periodic`: trace four layers of each run of identical layers and write out the rest
    (`planner.program.periodic`); where the trace does not repeat as the modules do, trace the whole model.
    `before_key`: what the model and its shape class are but for the optimizer and its implementation (the
    caller's key); the trace before the optimizer step is kept under it, and a later call with the same key
    splices its own optimizer step onto it without tracing the model again (`_BEFORE_STEP`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FAKE_DATA_PTR_WARNING, category=UserWarning)
        kw = {"loss_fn": loss_fn, "backend": backend, "flash_ok": flash_ok, "name": name, "source": source,
              "enable_checkpointing": enable_checkpointing, "scan_frees": scan_frees, "before_key": before_key}
        if periodic and PERIODIC_LAYERS:
            try:
                trace = _trace_step(build, make_batch, config, periodic=True, **kw)
            except Exception:  # noqa: BLE001 - code that needs every layer (`self.layers[i]` for i up to the
                trace = None  # config's count): the whole model says whether the step itself fails
            if trace is not None:
                return trace
        out = _trace_step(build, make_batch, config, periodic=False, **kw)
        assert out is not None
        return out


# Trace a run of identical layers as four and write out the rest (`planner.program.periodic`); False traces
# every layer (the reference the tests compare against).
PERIODIC_LAYERS = True


def _trace_step(build: Callable[[], torch.nn.Module], make_batch: Callable[[int, int], Any], config: TrainConfig,
               *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, backend: Backend = "cuda",
               flash_ok: bool = True, name: str = "model", source: str = "",
               enable_checkpointing: Callable[[torch.nn.Module], None] | None = None,
               scan_frees: bool = False, periodic: bool = False, before_key: Any = None) -> StepTrace | None:
    """One training step of `build()` on `make_batch(config.batch_size, config.seq_len)`, as a StepTrace.

    `build` and `make_batch` run inside FakeTensorMode, so parameters and inputs are fake from the start.
    `enable_checkpointing(module)` is called when `config.checkpointing` (HF models' per-layer checkpointing).
    `scan_frees`: find frees by the reference scan of every live storage after every op (`_Recorder`; slow,
    for the tests that check the callbacks give the same events).
    `periodic`: cut runs of identical layers to four and write the rest out (`planner.program.periodic`);
    None when the trace does not repeat as the modules do (then trace with periodic=False).
    """
    from torch._subclasses import fake_tensor as ft

    from planner.program import periodic as periodic_layers

    failed = _FAILED_BEFORE_STEP.get((before_key, periodic)) if before_key is not None else None
    if failed is not None:  # the model's step raised for another optimizer: it raises for this one too
        raise failed
    kept = _BEFORE_STEP.get((before_key, periodic)) if before_key is not None and not scan_frees else None
    if kept is not None and SPLICE_OPTIMIZER:
        step = optimizer_step(kept.metas, config, backend)
        if step is not None:
            return _finish(kept, step, config, name, backend)
    fake_errors = (ft.DataDependentOutputException, ft.DynamicOutputShapeException,
                   ft.UnsupportedFakeTensorException, ft.UnsupportedOperatorException)
    notes: list[str] = []
    mode = ft.FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _quiet_fake_tensor_log():
        old = torch.get_default_dtype()
        torch.set_default_dtype(MODEL_DTYPE[config.precision])
        try:
            module = build()
        finally:
            torch.set_default_dtype(old)
        module.train()
        if config.checkpointing and enable_checkpointing is not None:
            enable_checkpointing(module)
        batch = _to_model_dtype(make_batch(config.batch_size, config.seq_len), MODEL_DTYPE[config.precision])

        names = {id(m): n for n, m in module.named_modules()}
        with _module_stack(module, names) as stack:
            rec = _Recorder(backend, stack, scan=scan_frees)
            rec.repeats = layer_repeats(module)
            repeats = rec.repeats
            # not under checkpointing: a layer's recomputation runs before autograd names its block, so the
            # layers' windows in backward are not where `periodic` looks (traced whole, as before)
            runs = (periodic_layers.find_runs(module, lambda n: block_of(n, repeats))
                    if periodic and not scan_frees and not config.checkpointing else [])
            named = list(module.named_parameters())  # shared weights once (remove_duplicate=True)
            parameters: dict[str, int] = {}
            block_params: dict[str, int] = {}
            for pname, p in named:
                rec.register(p, "parameter")
                owner = pname.rsplit(".", 1)[0] if "." in pname else ""
                parameters[component_of(pname)] = parameters.get(component_of(pname), 0) + p.numel()
                block = block_of(owner, rec.repeats)
                block_params[block] = block_params.get(block, 0) + p.numel()
            parameters["total"] = sum(p.numel() for _, p in named)
            block_trainable: dict[str, int] = {}
            if any(not p.requires_grad for _, p in named):  # adapters on a frozen base
                for pname, p in named:
                    if p.requires_grad:
                        block = block_of(pname.rsplit(".", 1)[0] if "." in pname else "", rec.repeats)
                        block_trainable[block] = block_trainable.get(block, 0) + p.numel()
                parameters["trainable"] = sum(block_trainable.values())
                parameters["frozen"] = parameters["total"] - parameters["trainable"]
            buffers = {storage_key(b): b for b in module.buffers()}
            for b in buffers.values():
                rec.register(b, "buffer")
            inputs = {storage_key(t): t for t in _batch_tensors(batch)}
            for t in inputs.values():
                rec.register(t, "batch")
            excluded = {storage_key(p) for _, p in named} | set(buffers) | set(inputs)
            # the removed layers' gradients, made now (outside the recorder) and given to their parameters
            # after backward, so the optimizer step runs over the whole model's parameters
            standins = [(p, torch.empty_like(p), layer_name, kept_layer.get_parameter(pname))
                        for run in runs for layer_name, layer in zip(run.copies, run.removed_layers(), strict=True)
                        for kept_layer in (run.layers[run.first + periodic_layers.TEMPLATE],)
                        for pname, p in layer.named_parameters() if p.requires_grad]
            for run in runs:
                periodic_layers.truncate(run)
            forked_key = _fork_optimizer_step(named, config, backend) if SPLICE_OPTIMIZER and not scan_frees \
                else None

            saved: dict[int, SavedRecord] = {}
            saved_op: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = storage_key(t)
                if key in excluded:
                    return t
                info = rec.live.get(key)
                if info is None or info.ref.expired():
                    info = rec.register(t, "temporary", len(rec.ops) - 1)
                if info.sid not in saved and rec.phase == "forward":
                    info.category = "activation"
                    saved_op[info.sid] = len(rec.ops) - 1
                    dev = info.device
                    saved[info.sid] = SavedRecord(
                        info.sid, rec.block(), stack[-1] if stack else "", tuple(t.shape), dev.dtype,
                        info.numel * t.element_size(), cuda.allocation_bytes(dev.nbytes, backend), dev.rule)
                return (info.sid, t)

            def unpack(packed: Any) -> torch.Tensor:
                if isinstance(packed, tuple):
                    sid, t = packed
                    rec.backward_block = saved[sid].block if sid in saved else rec.backward_block
                    return t
                return packed

            autocast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPE[config.precision])
                        if config.precision in AUTOCAST_DTYPE else contextlib.nullcontext())
            cuda_amp = config.precision in AUTOCAST_DTYPE and backend == "cuda"
            fp32_ops = _cuda_autocast_fp32() if cuda_amp else contextlib.nullcontext()
            sdpa = _cuda_sdpa(config.attention, flash_ok) if backend == "cuda" else contextlib.nullcontext()
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack), rec, sdpa, fp32_ops:
                    with autocast:
                        output = _call(module, batch)
                        stack.clear()
                        loss = loss_fn(output, batch) if loss_fn is not None else default_loss(output)
                    forward_end = len(rec.ops)
                    retained_storages: list[tuple[str, int]] = []
                    retained = _retained(output, loss, rec, excluded, retained_storages)
                    rec.phase = "backward"
                    loss.backward()
                    backward_end = len(rec.ops)
                    for _, p in named:
                        if p.grad is not None:
                            rec.register(p.grad, "gradient", backward_end - 1).category = "gradient"
                    standin_of = _give_standins(rec, standins)
                    rec.phase = "optimizer"
                    trained = [p for _, p in named if p.requires_grad]
                    metas = tuple((_tensor_key(p), _tensor_key(p.grad)) for p in trained)
                    pending = _pending_frees(rec) if SPLICE_OPTIMIZER and not scan_frees and not stack else None
                    step = optimizer_step(metas, config, backend) if pending is not None else None
                    if step is None:  # run the step here (the reference; or it cannot be spliced)
                        pending = None
                        if not _step_optimizer(trained, config, rec):
                            notes.append(f"optimizer {config.optimizer}: not run in the trace (no torch class)")
            except fake_errors as exc:
                raise _remember(_fake_error(exc, rec.failed_in if rec.failed_in is not None else stack, source,
                                            type(module).__name__), before_key, periodic, rec) from None
            except PlannerError as exc:
                raise _remember(exc, before_key, periodic, rec) from None
            except Exception as exc:  # noqa: BLE001 - an error in the user's forward/loss: one line, exit 2
                from planner.models.user_module import last_line

                at = rec.failed_in if rec.failed_in is not None else stack
                where = (at[-1] or "(root)") if at else "the loss or backward"
                raise _remember(PlannerError("--model", source or name, f"the training step raised "
                                             f"{last_line(exc)} (in {where}); check --inputs matches the model"),
                                before_key, periodic, rec) from None
            finally:
                if forked_key is not None:  # not collected: the guess was wrong, or the step raised first
                    forked.discard(forked_key)

        for run in runs:
            periodic_layers.restore(run)
        saved_list = list(saved.values())
        before = _Before(
            rec.ops, rec.op_block, rec.raw_events, rec.event_stage, rec.event_late,
            {sid: (info.device.nbytes, info.device.dtype, info.category) for sid, info in rec.storages.items()},
            pending or [], rec.block(), metas, runs, saved_list, [saved_op[s.storage] for s in saved_list],
            retained, list(retained_storages), standin_of, forward_end, backward_end,
            tuple(tuple(p.shape) for _, p in named if p.requires_grad),
            named[0][1].element_size() if named else 4,
            sum(b.untyped_storage().nbytes() for b in buffers.values()),
            sum(t.untyped_storage().nbytes() for t in inputs.values()),
            parameters, block_params, block_trainable, tuple(notes),
            config.checkpointing and enable_checkpointing is not None)
        del output, loss
    if step is not None and before_key is not None:
        _BEFORE_STEP[(before_key, periodic)] = before
        while len(_BEFORE_STEP) > BEFORE_STEP_SIZE:
            del _BEFORE_STEP[next(iter(_BEFORE_STEP))]
    return _finish(before, step, config, name, backend)


@dataclass
class _Before:
    """A trace up to its optimizer step, as data: kept (`_BEFORE_STEP`) so that a shape class that differs
    only in the optimizer or its implementation splices its own step onto it instead of tracing again."""

    ops: list[OpRecord]
    op_block: list[str]
    events: list[tuple[int, str, int]]
    stage: list[int]
    late: list[bool]
    meta: dict[int, tuple[int, str, str]]  # storage id -> (device bytes, device dtype, category)
    pending: list[int]  # the model's temporaries that died after the last op: freed after the step's first op
    block: str  # the block the step's ops are counted in (the recorder's last backward block)
    metas: tuple  # the trained parameters' and gradients' metadata (`optimizer_step`)
    runs: list  # planner.program.periodic runs written out
    saved: list[SavedRecord]
    saved_op: list[int]
    retained: dict[str, int]
    retained_storages: list[tuple[str, int]]
    standin_of: dict[int, tuple[str, int]]
    forward_end: int
    backward_end: int
    grads: tuple[tuple[int, ...], ...]
    pbytes: int
    buffer_bytes: int
    batch_bytes: int
    parameters: dict[str, int]
    block_params: dict[str, int]
    block_trainable: dict[str, int]
    notes: tuple[str, ...]
    checkpointed: bool


# (the model and its shape class but the optimizer, whether layers are cut) -> the trace before its step
_BEFORE_STEP: dict[tuple, _Before] = caches.table(
    "planner.program.trace._BEFORE_STEP", scope="model",
    key="(source kind, its arguments, config JSON without the optimizer and its implementation, periodic)")
BEFORE_STEP_SIZE = 64  # kept per process, the oldest out first (each holds a trace's op and event lists)


# (before_key, periodic) -> the error the model's step raised before its optimizer step (a BatchNorm given one
# sample): the same error for a shape class that differs only in the optimizer, without tracing again
_FAILED_BEFORE_STEP: dict[tuple, PlannerError] = caches.table(
    "planner.program.trace._FAILED_BEFORE_STEP", scope="model",
    key="(source kind, its arguments, config JSON without the optimizer and its implementation, periodic)")


def _remember(err: PlannerError, before_key: Any, periodic: bool, rec: _Recorder) -> PlannerError:
    """`err`, kept under `before_key` where it was raised before the optimizer step (which alone differs
    between the shape classes sharing the key)."""
    if before_key is not None and rec.phase != "optimizer":
        _FAILED_BEFORE_STEP[(before_key, periodic)] = err
    return err


def _pending_frees(rec: _Recorder) -> list[int] | None:
    """Storage ids of the model's temporaries whose death was reported since the last op (what `_poll` frees
    after the next op), in registration order; None where one is dead only as a Python object (its storage
    may die at any later op: then the step is run in the trace)."""
    if rec.scanned:
        return None
    out: set[int] = set()
    for key in rec.dead:
        info = rec.polled.get(key)
        if info is None:
            continue
        if not _EXPIRED(info.ref.cdata):
            return None
        out.add(info.sid)
    return sorted(out)


def _finish(before: _Before, step: OptimizerStep | None, config: TrainConfig, name: str,
            backend: Backend) -> StepTrace | None:
    """The StepTrace of `before` with `step` spliced in (None: the step is in `before` already); layers
    written out (`planner.program.periodic`); None where they do not repeat."""
    from planner.program import periodic as periodic_layers

    ops, op_block, raw_events = list(before.ops), list(before.op_block), list(before.events)
    stages, lates, meta = list(before.stage), list(before.late), dict(before.meta)
    notes = before.notes
    if step is not None:
        if not step.ran:
            notes = (*notes, f"optimizer {config.optimizer}: not run in the trace (no torch class)")
        step.splice(ops, op_block, raw_events, stages, lates, meta, before.pending, before.block)
    forward_end, backward_end = before.forward_end, before.backward_end
    saved_list, retained_storages = before.saved, before.retained_storages
    if before.runs:
        raw: periodic_layers.Raw | None = periodic_layers.Raw(
            ops, op_block, [(*e, stage, late) for e, stage, late in zip(raw_events, stages, lates, strict=True)],
            meta, list(saved_list), list(before.saved_op), list(retained_storages), dict(before.standin_of))
        for run in before.runs:
            raw = periodic_layers.expand(raw, run) if raw is not None else None
        if raw is None:
            return None
        ops, op_block = raw.ops, raw.op_block
        forward_end, backward_end = raw.forward_end, raw.backward_end
        raw_events, meta, saved_list, retained_storages = periodic_layers.renumber(raw)
    events = tuple(StorageEvent(op, action, sid, *meta[sid]) for op, action, sid in raw_events)
    blocks = block_memory(events, tuple(op_block), tuple(saved_list), before.block_params, before.retained,
                          forward_end, backward_end, backend, frozenset(sid for _, sid in retained_storages))
    return StepTrace(name=name, backend=backend, parameters=before.parameters, gradient_shapes=before.grads,
                     parameter_dtype_bytes=before.pbytes, buffer_bytes=before.buffer_bytes,
                     batch_bytes=before.batch_bytes, blocks=blocks, saved=tuple(saved_list), ops=tuple(ops),
                     events=events, checkpointed=before.checkpointed, notes=notes, op_blocks=tuple(op_block),
                     block_parameters=before.block_params, block_trainable=before.block_trainable,
                     retained_storages=tuple(retained_storages))


# Splice the optimizer step, traced once per parameter list and optimizer (`optimizer_step`), into every trace
# of a model; False runs it in every trace (the reference the tests compare against).
SPLICE_OPTIMIZER = True


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step as the recorder saw it, apart from the model: its ops, and its storage events over
    storages of its own (numbered from 0; the parameters' and gradients' storages have no event in it).

    Why: the step (AdamW's foreach ops over every parameter tensor) was a fifth to a third of each trace and
    depends only on the parameters and gradients (shapes, strides, dtypes, which have a gradient), the
    optimizer, its implementation and the backend, never on the batch, length, precision of the compute or
    checkpointing; a search traces one model at many shape classes."""

    ran: bool  # a torch optimizer ran (else the trace notes it did not)
    spliceable: bool  # False: the step touched a parameter's or gradient's storage (the trace runs it itself)
    ops: tuple[OpRecord, ...]  # indices from 0
    events: tuple[tuple[int, str, int, int, bool], ...]  # (op from 0, or -1; action; own storage; stage; late)
    storages: tuple[tuple[int, str, cuda.Storage, str], ...]  # own storages: (numel, dtype, device, category)

    def splice(self, ops: list[OpRecord], op_block: list[str], events: list[tuple[int, str, int]],
               stages: list[int], lates: list[bool], meta: dict[int, tuple[int, str, str]], pending: list[int],
               block: str) -> None:
        """Append the step as if it had run after `ops`: `pending` (the model's temporaries that died after
        the last op) are freed after the step's first op, after its results and before its own frees (the
        recorder frees in registration order, `_Recorder._poll`), as the recorder does for an op that runs."""
        base_op, base_sid = len(ops), len(meta)
        for i, (_, _, device, category) in enumerate(self.storages):
            meta[base_sid + i] = (device.nbytes, device.dtype, category)
        for op in self.ops:
            ops.append(OpRecord(base_op + op.index, op.name, op.phase, op.module, op.inputs, op.outputs, op.flops,
                                op.kernel))
            op_block.append(block)
        waiting = bool(self.ops)

        def flush() -> None:
            for sid in pending:
                events.append((base_op, "free", sid))
                stages.append(1)
                lates.append(True)

        for op, action, sid, stage, late in self.events:
            if waiting and (op != 0 or action == "free"):
                flush()
                waiting = False
            events.append((base_op + op if op >= 0 else op, action, base_sid + sid))
            stages.append(stage)
            lates.append(late)
        if waiting:
            flush()


# (optimizer, implementation, backend, each trained parameter's and its gradient's shape, stride, dtype) ->
# the step, traced once per process (`optimizer_step`)
_OPTIMIZER_STEPS: dict[tuple, OptimizerStep] = caches.table(
    "planner.program.trace._OPTIMIZER_STEPS", scope="model",
    key="(optimizer, implementation, backend, shapes, strides and dtypes of the parameters and gradients)")


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
                                   t.untyped_storage().nbytes())


def optimizer_step(metas: tuple, config: TrainConfig, backend: Backend) -> OptimizerStep | None:
    """The optimizer step over `params` (with their gradients), traced once per key (`_OPTIMIZER_STEPS`) on
    stand-in parameters of the same shapes in a FakeTensorMode of its own; None where the traced step
    touches a parameter's or gradient's storage (then the trace runs the step itself)."""
    key = (config.optimizer, config.optimizer_impl, backend, metas)
    if key not in _OPTIMIZER_STEPS:
        step = forked.collect(key)  # traced in a child meanwhile (`_fork_optimizer_step`), else here
        _OPTIMIZER_STEPS[key] = step if step is not None else _traced_optimizer_step(metas, config, backend)
    step = _OPTIMIZER_STEPS[key]
    return step if step.spliceable else None


def _traced_optimizer_step(metas: tuple, config: TrainConfig, backend: Backend) -> OptimizerStep:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # the trace's FakeTensorMode and recorder do not see this one
        return _trace_optimizer_step(metas, config, backend)


def _grad_key_guess(p: torch.Tensor) -> tuple | None:
    """The gradient's metadata as autograd makes it for a dense parameter (torch/csrc/autograd/functions/
    accumulate_grad.h: a new gradient follows the parameter's strides, in a storage of its own), None where
    the parameter is not dense; a guess, checked against the real gradient before its step is used."""
    if not p.is_contiguous() and not p.is_contiguous(memory_format=torch.channels_last):
        return None
    return (tuple(p.shape), p.stride(), 0, p.dtype, p.numel() * p.element_size())


def _fork_optimizer_step(named: list[tuple[str, torch.nn.Parameter]], config: TrainConfig,
                         backend: Backend) -> tuple | None:
    """Start tracing the optimizer step in a forked child (`planner.program.forked`) on the metadata the
    gradients will have (`_grad_key_guess`: every trained parameter gets a gradient laid out as itself),
    while this process traces the forward and backward; `optimizer_step` takes the child's answer when the
    real metadata are the guessed ones. Returns the key started under, None where nothing was started."""
    trained = [p for _, p in named if p.requires_grad]
    guess = []
    for p in trained:
        g = _grad_key_guess(p)
        if g is None:
            return None
        guess.append((_tensor_key(p), g))
    key = (config.optimizer, config.optimizer_impl, backend, tuple(guess))
    if key in _OPTIMIZER_STEPS or not trained:
        return None
    metas = key[3]
    return key if forked.start(key, lambda: _traced_optimizer_step(metas, config, backend)) else None


def _trace_optimizer_step(metas: tuple, config: TrainConfig, backend: Backend) -> OptimizerStep:
    from torch._subclasses import fake_tensor as ft

    with ft.FakeTensorMode(allow_non_fake_inputs=True), _quiet_fake_tensor_log():
        standins = []
        for p, g in metas:
            q = torch.nn.Parameter(torch.empty_strided(p[0], p[1], dtype=p[3]), requires_grad=True)
            if g is not None:
                q.grad = torch.empty_strided(g[0], g[1], dtype=g[3])
            standins.append(q)
        rec = _Recorder(backend, [])
        rec.phase = "optimizer"
        for q in standins:
            rec.register(q, "parameter")
            if q.grad is not None:
                rec.register(q.grad, "gradient")
        own, first_event = len(rec.storages), len(rec.raw_events)
        with rec:
            stepped = _step_optimizer(standins, config, rec)  # made under the recorder, as in the trace
    events = tuple((op, action, sid - own, stage, late) for (op, action, sid), stage, late in
                   zip(rec.raw_events[first_event:], rec.event_stage[first_event:], rec.event_late[first_event:],
                       strict=True))
    if any(sid < 0 for _, _, sid, _, _ in events) or rec.scanned:
        return OptimizerStep(False, False, (), (), ())  # touches the model's storages: not spliced (see optimizer_step)
    storages = tuple((i.numel, i.dtype, i.device, i.category) for sid, i in sorted(rec.storages.items())
                     if sid >= own)
    return OptimizerStep(stepped, True, tuple(rec.ops), events, storages)


def _give_standins(rec: _Recorder, standins: list[tuple[torch.nn.Parameter, torch.Tensor, str, torch.nn.Parameter]]
                   ) -> dict[int, tuple[str, int]]:
    """Each removed layer's parameter gets its stand-in gradient, known to the recorder as a live gradient
    storage with no event of its own (the written-out copy's gradient storage is its events); returns stand-in
    storage id -> (the removed layer, the storage id of the same parameter's gradient in layer C)."""
    out: dict[int, tuple[str, int]] = {}
    for p, g, layer, kept in standins:
        if kept.grad is None:  # the parameter gets no gradient in the whole model either
            continue
        p.grad = g
        st = g.untyped_storage()
        info = _StorageInfo(len(rec.storages), StorageWeakRef(st), st.nbytes() // g.element_size(),
                            dtype_name(g.dtype), cuda.Storage(st.nbytes() // g.element_size(), dtype_name(g.dtype)),
                            "", "gradient")
        rec.storages[info.sid] = info
        rec.live[storage_key(g)] = info
        out[info.sid] = (layer, rec.live[storage_key(kept.grad)].sid)
    return out


def _retained(output: Any, loss: torch.Tensor, rec: _Recorder, excluded: set[int],
              storages: list[tuple[str, int]]) -> dict[str, int]:
    """Model outputs other than the loss that the loop keeps alive through backward (`outputs = model(...)`),
    bytes per block; `storages` collects (block, storage id) of each."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    for t in _batch_tensors(items):
        key = storage_key(t)
        info = rec.live.get(key)
        if key in excluded or key in seen or info is None or info.category == "activation" or t is loss:
            continue
        seen.add(key)
        out[info.block] = out.get(info.block, 0) + cuda.allocation_bytes(info.device.nbytes, rec.backend)
        storages.append((info.block, info.sid))
    return out



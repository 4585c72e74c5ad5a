"""Throughput of a traced model: its own ATen ops as the roofline's kernel list.

Why: a traced model (user code, a config.json outside the six families) has no hand-written kernel list
(`planner.perf.kernels`), but the trace holds every op of its forward and backward with shapes, dtypes and
FLOPs (`torch.utils.flop_counter`'s formulas, counted while tracing). Each op that launches a kernel becomes
one `Kernel`, timed by the same roofline and step model as the analytic path (`perf.throughput.
table_throughput`): same GPU facts, efficiencies, CPU dispatch floor, communication and optimizer kernels.

One op = one kernel:
- kind: matmuls (mm, addmm, bmm, baddbmm) are GEMMs with their (batch, m, n, k) for the tile/wave rule;
  convolutions are GEMMs at the plain GEMM efficiency (implicit GEMM, no tile shape); the fused SDPA ops
  (flash, memory-efficient, forward and backward) are fused attention; everything else is memory-bound.
- bytes: every tensor argument read once, every output written once (an embedding lookup reads only the
  rows it gathers: its output's size).
- phase: forward; backward; ops run inside a module's forward during backward are checkpoint recomputation.
- compute dtype: the first floating input's (16-bit under autocast: the tracer runs CPU autocast, with CUDA's
  fp32 op list applied).
- CPU -> CUDA (issue 36): CPU dropout is three ops (aten/src/ATen/native/Dropout.cpp `_dropout_impl`:
  `noise.bernoulli_(1 - p)`, `noise.div_(1 - p)`, `input * noise`), CUDA's one fused `native_dropout` kernel
  (aten/src/ATen/native/cuda/Dropout.cu `fused_dropout_kernel`: reads x, writes the output and a 1-byte mask);
  the three are timed as that one kernel (`cuda_rows`). The backward's `grad * noise` is left as traced (CUDA's
  `native_dropout_backward` reads a 1-byte mask where it reads the noise: one pass either way).
The optimizer is not taken from the trace: `perf.kernels.optimizer_kernels` over the parameter count and
tensor count, as in the analytic path (the trace's optimizer ops are one per tensor for the for-loop
implementation and the same multi-tensor launches otherwise).

ASSUMPTION: tokens per sample = the sequence length (models without a sequence — images, tables — still get
a tokens/s column; samples/s is the figure that means something for them).
"""

from __future__ import annotations

import numpy as np

from planner import caches
from planner.perf.kernels import KINDS
from planner.perf.roofline import PHASES, KernelTable
from planner.perf.throughput import ThroughputConstants, table_throughput
from planner.program import cuda
from planner.program.records import OpRecord, StepTrace, TensorMeta
from planner.spec import BYTES_PER_DTYPE, Instance, Throughput, TrainConfig

GEMM_OPS = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten.bmm.default": 0, "aten.baddbmm.default": 1}
CONVOLUTION_OPS = ("aten.convolution.default", "aten.convolution_backward.default", "aten.cudnn_convolution",
                   "aten._convolution.default")
FUSED_ATTENTION_PREFIXES = ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                            "aten._flash_attention", "aten._efficient_attention",
                            "aten._scaled_dot_product_cudnn_attention")
ROW_GATHER_OPS = ("aten.embedding.default",)


def _nbytes(m: TensorMeta) -> int:
    n = 1
    for d in m.shape:
        n *= d
    return n * BYTES_PER_DTYPE.get(m.dtype, 4)


def _compute_dtype(op: OpRecord) -> str:
    floating = [m.dtype for m in op.inputs if m.dtype in ("float32", "float16", "bfloat16", "float64")]
    return floating[0] if floating else (op.outputs[0].dtype if op.outputs else "float32")


def _gemm_dims(op: OpRecord) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul from its operand shapes (bias first for addmm/baddbmm)."""
    skip = GEMM_OPS.get(op.name)
    if skip is None or len(op.inputs) < skip + 2:
        return None
    a, b = op.inputs[skip].shape, op.inputs[skip + 1].shape
    if len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1]
    if len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2]
    return None


def op_kind(op: OpRecord) -> str:
    if op.name in GEMM_OPS or op.name.startswith(CONVOLUTION_OPS):
        return "gemm"
    if op.name.startswith(FUSED_ATTENTION_PREFIXES):
        return "attention"
    return "memory_bound"


def op_phase(op: OpRecord) -> str:
    """forward, backward, or recompute (a module's forward running during backward: checkpointing)."""
    if op.phase == "backward" and op.module:
        return "recompute"
    return op.phase


def op_row(op: OpRecord) -> tuple[str, str, tuple[int, int, int, int] | None, float, float]:
    """(kind, dtype, gemm dims, FLOPs, bytes) of one op."""
    kind = op_kind(op)
    written = sum(_nbytes(m) for m in op.outputs)
    if op.name in ROW_GATHER_OPS:
        read = written + sum(_nbytes(m) for m in op.inputs[1:2])
    else:
        read = sum(_nbytes(m) for m in op.inputs)
    return kind, _compute_dtype(op), _gemm_dims(op) if kind == "gemm" else None, float(op.flops), float(read + written)


DROPOUT_TAIL = ("aten.div_.Scalar", "aten.mul.Tensor")  # after the noise's bernoulli_: scale it, multiply


def _numel(m: TensorMeta) -> int:
    n = 1
    for d in m.shape:
        n *= d
    return n


def cuda_rows(ops: list[OpRecord]) -> list[tuple[OpRecord, tuple]]:
    """(op, op_row) of each kernel CUDA runs for `ops`: CPU's dropout triple (bernoulli_, div_, mul over the
    same elements) as one fused dropout kernel (module docstring), every other op as traced."""
    out: list[tuple[OpRecord, tuple]] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        tail = ops[i + 1:i + 3]
        if (op.name == cuda.DROPOUT_NOISE_OP and op.outputs and tuple(t.name for t in tail) == DROPOUT_TAIL
                and all(t.outputs and _numel(t.outputs[0]) == _numel(op.outputs[0]) for t in tail)):
            x = tail[1].outputs[0]
            n = _numel(x)
            nbytes = 2 * _nbytes(x) + n * BYTES_PER_DTYPE["bool"]  # read x; write the output and the mask
            out.append((op, ("memory_bound", x.dtype, None, 0.0, float(nbytes))))
            i += 3
            continue
        out.append((op, op_row(op)))
        i += 1
    return out


def traced_dynamic_cast(op: OpRecord) -> bool:
    """A traced elementwise op over mixed floating dtypes (planner.perf.kernels.needs_dynamic_cast)."""
    from planner.perf.kernels import needs_dynamic_cast

    return needs_dynamic_cast(tuple(m.dtype for m in op.inputs), tuple(m.dtype for m in op.outputs))


def kernel_table(trace: StepTrace) -> KernelTable:
    """The micro-step's kernels (forward, backward, recompute) of a trace, at its own batch size (per_b = 0)."""
    pairs = cuda_rows([op for op in trace.ops if op.kernel and op.phase in ("forward", "backward")])
    ops = [op for op, _ in pairs]
    rows = [row for _, row in pairs]
    base = np.array([[f, b, *(g or (0, 0, 0, 0))] for _, _, g, f, b in rows], dtype=float).reshape(len(rows), 6)
    return KernelTable(
        names=tuple(op.name for op in ops),
        kind=np.array([KINDS.index(k) for k, *_ in rows], dtype=int),
        phase=np.array([PHASES.index(op_phase(op)) for op in ops], dtype=int),
        count=np.ones(len(ops)),
        launches=np.ones(len(ops)),
        dtype=tuple(d for _, d, *_ in rows),
        is_gemm=np.array([g is not None for _, _, g, *_ in rows], dtype=bool),
        is_fused_attention=np.array([k == "attention" for k, *_ in rows], dtype=bool),
        base=base, per_b=np.zeros_like(base),
        dynamic_cast=np.array([k == "memory_bound" and traced_dynamic_cast(op) for op, (k, *_) in pairs],
                              dtype=bool))


_TABLES: dict[int, tuple[StepTrace, KernelTable]] = caches.table("planner.program.speed._TABLES", scope="model",
    key="traced step identity: (StepTrace, KernelTable)")
TABLE_CACHE_SIZE = 64  # as planner.program.sources.TRACE_CACHE_SIZE: one table per cached trace


def _table(trace: StepTrace) -> KernelTable:
    """`kernel_table`, cached per trace object (traces are cached per shape class, so a search reuses both)."""
    hit = _TABLES.get(id(trace))
    if hit is None or hit[0] is not trace:
        if len(_TABLES) >= TABLE_CACHE_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        hit = _TABLES[id(trace)] = (trace, kernel_table(trace))
    return hit[1]


def traced_throughput(trace: StepTrace, config: TrainConfig, instance: Instance,
                      constants: ThroughputConstants | None = None) -> Throughput:
    """Step time, samples/s, tokens/s and MFU of the traced step under `config` on `instance`."""
    n_tensors = len(trace.gradient_shapes)
    n_params = sum(int(np.prod(s)) for s in trace.gradient_shapes)
    return table_throughput(_table(trace), n_params, max(n_tensors, 1), config.seq_len, config, instance, constants)

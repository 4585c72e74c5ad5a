"""The spec-dependent steps of `planner explain` for a traced model, read from its trace (no ModelSpec)."""

from __future__ import annotations

from typing import Any

from planner.explain_where import batch_where
from planner.memory.model_states import parameter_dtype_bytes
from planner.spec import Estimate
from planner.units import fmt_bytes

TOP_SAVED = 6  # saved-tensor groups listed, largest first


class TracedView:
    """What explain needs of a model, from the cached trace of `model` under the estimate's configuration."""

    def __init__(self, model: str, est: Estimate, options: dict[str, Any] | None, inputs: str | None,
                 loss: str | None):
        from planner.hardware import get_instance
        from planner.program.sources import model_trace

        self.est = est
        inst = get_instance(est.instance)
        self.trace = model_trace(model, est.config.model_copy(update={"checkpointing": False}), options=options,
                                 inputs=inputs, loss=loss, flash_ok=inst.gpu.flash_attention)
        self.description = f"traced from {model} on CPU fake tensors, CUDA-mapped"

    def component_lines(self) -> list[str]:
        """Top-level children with their parameters (shared weights counted once, with their first owner)."""
        return [f"{name}: {n:,} parameters" for name, n in self.est.parameters.items() if name != "total"]

    def activation_lines(self) -> list[str]:
        cfg, m = self.est.config, self.est.memory_bytes
        lines = ["The autograd graph's GPU cost IS the tensors it saves for backward; the node objects live in "
                 "host memory. Measured here by running your forward on fake tensors with saved-tensor hooks.",
                 f"One micro-batch ({cfg.batch_size} × {cfg.seq_len}, {cfg.precision}) keeps "
                 f"{fmt_bytes(m.activations)}. Largest saved tensors (shape, dtype on the GPU, module):"]
        groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
        for s in self.trace.saved:
            groups.setdefault((".".join(s.module.split(".")[-2:]) or s.block, s.shape, s.dtype), []).append(s.device_bytes)
        top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:TOP_SAVED]
        for (module, shape, dtype), sizes in top:
            lines.append(f"  {len(sizes)} × {list(shape)} {dtype} in {module}: {fmt_bytes(sum(sizes))}")
        if cfg.checkpointing:
            lines.append("With checkpointing each layer keeps only its input; backward recomputes one layer at a "
                         "time.")
        return lines

    def data_lines(self) -> list[str]:
        cfg = self.est.config
        pb = parameter_dtype_bytes(cfg.precision)
        batch = [e for e in self.trace.events if e.category == "batch" and e.action == "alloc"]
        lines = [f"Parameters and gradients: {pb} B each; optimizer states as the parameters' dtype."]
        lines += [f"input storage {i + 1}: {e.dtype}, {fmt_bytes(e.nbytes)}" for i, e in enumerate(batch)]
        lines.append(f"Input batch in all: {fmt_bytes(self.est.memory_bytes.batch)} {batch_where(self.est)}.")
        return lines

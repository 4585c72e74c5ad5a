"""LoRA on a traced model (`--model file.py:build`, a config.json outside the six families): peft's own
adapters put on the module the tracer builds, so the trace measures what they save and which parameters train.

`peft.inject_adapter_in_model` keeps the module's names (the tracer attributes ops to blocks by name; a
`PeftModel` wrapper would rename them) and freezes the base; the adapters are then cast to fp32 as
`get_peft_model`'s autocast_adapter_dtype does. A 4-bit base cannot be traced (bitsandbytes kernels do not run
on fake tensors): --base-dtype nf4 is refused for traced models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from planner.errors import PlannerError
from planner.spec import TrainConfig


def check_traced(config: TrainConfig) -> None:
    if config.base_dtype == "nf4":
        raise PlannerError("--base-dtype", "nf4", "fp32, bf16, fp16 or auto for a traced model (4-bit layers "
                           "cannot run on the tracer's fake tensors); catalog models and the six families' "
                           "configs take nf4")
    if config.base_dtype != "auto":
        raise PlannerError("--base-dtype", config.base_dtype, "auto for a traced model (it is traced in the "
                           "dtype --precision implies)")
    if not config.lora_targets:
        raise PlannerError("--lora-targets", "", "module names or all-linear for a traced model")


def with_adapters(build: Callable[[], Any], config: TrainConfig) -> Callable[[], Any]:
    """`build`, then peft's LoRA on the module (as the config asks), adapters in fp32."""
    if not config.lora:
        return build
    check_traced(config)

    def build_with_lora() -> Any:
        try:
            import peft
        except ImportError:
            raise PlannerError("--lora-r", config.lora_r, "peft installed to trace adapters (pip install "
                               "peft)") from None
        from torch._subclasses.fake_tensor import FakeTensor

        module = build()
        targets: Any = "all-linear" if config.lora_targets == ("all-linear",) else list(config.lora_targets)
        lora = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha if config.lora_alpha else 8,
                               lora_dropout=config.lora_dropout, target_modules=targets)
        fake = any(isinstance(p, FakeTensor) for p in module.parameters())
        try:
            if fake:  # peft cannot move fake tensors: inject on meta, then back to fake CPU tensors
                import torch

                from planner.program.hf import empty_like_on_cpu

                _to_meta(module)
                with _adapters_stay_where_made(fake), torch.device("meta"):
                    module = peft.inject_adapter_in_model(lora, module)
                _adapters_in_fp32(module)
                module = empty_like_on_cpu(module)
            else:
                module = peft.inject_adapter_in_model(lora, module)
        except ValueError as exc:
            raise PlannerError("--lora-targets", ",".join(config.lora_targets), str(exc).splitlines()[0]) from None
        _adapters_in_fp32(module)
        return module

    return build_with_lora


def _to_meta(module: Any) -> None:
    """Every parameter and buffer as a meta tensor (shared ones stay shared), requires_grad kept."""
    from planner.program.hf import empty_like_on

    empty_like_on(module, "meta")


def _adapters_in_fp32(module: Any) -> None:
    """Adapters as fp32 parameters (peft's autocast_adapter_dtype); under the tracer they were made on meta
    (`low_cpu_mem_usage`), and become (fake) CPU tensors here, as the tracer's builders make every weight."""
    import torch

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.requires_grad:
                continue
            if p.device.type == "meta":
                sub._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="cpu"))
            elif p.dtype != torch.float32:
                p.data = p.data.float()


@contextmanager
def _adapters_stay_where_made(fake: bool) -> Iterator[None]:
    """Under the tracer the adapters are made as fake CPU tensors already; peft's move to the base weight's
    device and dtype (`LoraLayer._move_adapter_to_device_of_base_layer`) cannot swap fake tensors into
    parameters, and the dtype is set to fp32 right after anyway, so the move is skipped there."""
    if not fake:
        yield
        return
    from peft.tuners.lora.layer import LoraLayer

    original = LoraLayer._move_adapter_to_device_of_base_layer
    LoraLayer._move_adapter_to_device_of_base_layer = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        LoraLayer._move_adapter_to_device_of_base_layer = original  # type: ignore[method-assign]

"""The host side of a training step: the CPU time eager PyTorch spends launching the GPU's work, and how much
of it the GPU's own work hides.

Why a model of its own: at small micro-batches a modern GPU finishes each kernel before Python has dispatched
the next, so the step takes the host's time, not the GPU's (the shared H200 readings: BERT-base b8 s128 AMP,
24.7 ms a step with the GPU busy 35 % of it; 1,224 kernels and ~6,700 ATen calls a step). The host's cost per
launch depends on

- the software stack: torch's dispatcher and autograd, transformers' Python per module, eager or compiled.
  Only one stack has readings (torch 2.11, transformers 5.17, eager), so the fitted cost is that stack's;
  other stacks use it unchanged (older torch 1.x stacks are slower per op: the public runs at micro-batch 1
  show it, and nothing here is fitted to them);
- the CPU: single-thread speed, approximated by the instance's sourced all-core/boost clock
  (instances.json `cpu_ghz`) against the readings' host, whose clock was not recorded:
  `READINGS_HOST_GHZ` is an ASSUMPTION, and an instance without a sourced clock takes factor 1.

Overlap: the GPU computes while Python dispatches the next ops, but syncs (loss, GradScaler, optimizer) and
a queue that runs dry at short kernels leave part of both exposed. A p-norm joins the two smoothly:
max(gpu, host) when one dominates, up to 2^(1/p) × either when they are equal.
"""

from __future__ import annotations

from planner.spec import Instance

# ASSUMPTION: the clock of the host that took the shared readings (not recorded in env.json): a current
# server core's boost clock. Only the ratio to an instance's sourced clock uses it.
READINGS_HOST_GHZ = 3.5
# Bounds on the CPU factor: clocks are a coarse proxy for single-thread speed across CPU generations.
MIN_CPU_FACTOR, MAX_CPU_FACTOR = 0.7, 2.0


def cpu_factor(instance: Instance) -> float:
    """How much longer than on the readings' host each launch takes on this instance's CPU (1.0 unknown)."""
    ghz = instance.cpu_ghz
    if not ghz:
        return 1.0
    return min(MAX_CPU_FACTOR, max(MIN_CPU_FACTOR, READINGS_HOST_GHZ / ghz))


def host_seconds(launches: float, per_launch_s: float, instance: Instance) -> float:
    """Host time to dispatch `launches` CUDA launches on this instance."""
    return launches * per_launch_s * cpu_factor(instance)


def overlapped(gpu_s: float, host_s: float, power: float) -> float:
    """Wall time of GPU work and host dispatch running side by side: (gpu^p + host^p)^(1/p)."""
    if host_s <= 0:
        return gpu_s
    if gpu_s <= 0:
        return host_s
    hi = max(gpu_s, host_s)
    return hi * (1.0 + (min(gpu_s, host_s) / hi) ** power) ** (1.0 / power)


def bound_by(gpu_s: float, host_s: float) -> str:
    """'host' when dispatch takes longer than the GPU's kernels, else 'gpu'."""
    return "host" if host_s > gpu_s else "gpu"

"""Every constant of the throughput model, in a module of its own so that the collectives' timings
(planner.perf.collectives) and the step model (planner.perf.throughput) both read it without importing each
other (issue 33: the two modules were a cycle through this class)."""

from __future__ import annotations

from pydantic import Field

from planner.perf.roofline import RooflineConstants


class ThroughputConstants(RooflineConstants):
    """Every constant of the throughput model (the roofline's and communication's); override any field with
    `model_copy(update={...})`."""

    causal_fraction: float = Field(
        1.0, gt=0, le=1,
        description="share of the s^2 attention FLOPs executed for causal models; 1.0 counts them full "
                    "(FlopCounterMode convention); a causal flash kernel computes ~0.5")
    allreduce_overlap: float = Field(
        0.5, ge=0, le=1,
        description="share of the gradient all-reduce hidden behind backward by DDP's bucketing "
                    "(bucket_cap_mb=25: all but the last buckets overlap; ASSUMPTION)")
    network_efficiency_efa: float = Field(
        0.8, gt=0, le=1, description="share of the instance's network Gbps NCCL reaches over EFA (ASSUMPTION)")
    network_efficiency_tcp: float = Field(
        0.4, gt=0, le=1,
        description="share of network Gbps NCCL reaches over TCP sockets without EFA; 'up to' figures are "
                    "burst rates (ASSUMPTION)")
    rank_speed_spread: float = Field(
        0.055, ge=0, le=0.5,
        description="spread (coefficient of variation) of per-GPU step speed: n synchronous GPUs wait "
                    "rank_speed_spread x E[max of n standard normals] of the compute time for the slowest; "
                    "fitted to the scaling of multi-GPU runs in results/public (benchmarks/fit_scaling.py); it "
                    "also absorbs any other loss that grows with the GPU count (gradient bucket copies, NCCL "
                    "kernels sharing SMs and HBM with backward)")
    slowest_gpu_wait_cap: float = Field(
        0.08, ge=0,
        description="the wait for the slowest GPU is at most this share of the compute time however many GPUs: "
                    "Sinha et al., 'Not All GPUs Are Created Equal', SC22 (arXiv 2208.11035v3) measured 8 % "
                    "average performance variation (max 22 %) across >90 % of the GPUs of each of five clusters "
                    "(thousands of V100s and MI60s each), outliers (up to 1.5x the median) apart; the slowest "
                    "GPU of any subset of a population lags by no more than the population's range. ASSUMPTION: "
                    "such outliers are taken out of service (health checks). rank_speed_spread x E[max of n "
                    "normals] reaches it beyond 8 GPUs (0.055 x 1.42 = 7.8 % at 8), so the fitted runs are "
                    "unchanged")
    dp_replicate_overhead_s: float = Field(
        0.01, ge=0,
        description="DataParallel's per-micro-step cost beyond its copies and GIL-bound dispatch: starting "
                    "one Python thread per replica (parallel_apply) and replicate()'s per-module Python "
                    "copies (ASSUMPTION)")
    dp_gil_share: float = Field(
        1.0, ge=0, le=1,
        description="share of each forward op's host time that holds the GIL, so that DataParallel's replica "
                    "threads dispatch one after another (ASSUMPTION, an upper bound: ATen releases the GIL "
                    "inside the op, the Python module call and argument parsing hold it)")
    shard_overlap: float = Field(
        1.0, ge=0, le=1,
        description="share of a ZeRO-3/FSDP per-unit all-gather or reduce-scatter (all but the first unit of "
                    "a phase) that can hide behind the compute of the unit it is prefetched beside, never "
                    "more than that compute (planner.perf.collectives: FSDP's and ZeRO-3's prefetch, one "
                    "unit ahead on its own stream). 1.0: the pipeline bound itself; what overlap costs is "
                    "counted apart, as the SMs NCCL's blocks take from compute (was 0.5, an ASSUMPTION that "
                    "exposed half of every unit's collective however long the compute beside it)")
    nccl_base_latency_s: float = Field(
        8.4e-6, ge=0,
        description="fixed latency of one NCCL ring collective, Ring/Simple baseLat (NVIDIA/nccl "
                    "src/graph/tuning.cc @01afd20: 8.4 us; SOURCED)")
    nccl_hop_latency_nvlink_s: float = Field(
        3.4e-6, ge=0, description="NCCL latency per ring step over NVLink, hwLat NVLINK Ring/Simple "
                                  "(tuning.cc: 3.4 us; SOURCED)")
    nccl_hop_latency_pci_s: float = Field(
        5.7e-6, ge=0, description="NCCL latency per ring step over PCIe, hwLat PCI Ring/Simple (tuning.cc: "
                                  "5.7 us; SOURCED)")
    nccl_hop_latency_net_s: float = Field(
        9.6e-6, ge=0, description="NCCL latency per ring step between instances, hwLat NET Ring/Simple "
                                  "(tuning.cc: 9.6 us; SOURCED)")

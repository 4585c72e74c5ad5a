"""The AWS PyTorch Deep Learning Containers (DLC) the planner knows: their torch, CUDA and GPU architectures.

A fact table, read by the default software stack (planner.memory.stack: the DLC `probe launch` would use
sets the torch and CUDA an estimate assumes) and by the image choice (planner.aws.images). It lives outside
planner/aws so that the core never imports the AWS edge.


A DLC is usable on a GPU only if its PyTorch wheel carries kernels for that GPU's architecture: a cubin
for compute capability (M, m') runs on (M, m) when m' <= m (same major), and PTX for (M, m') JIT-compiles
on anything >= (M, m'). The arch lists below are those of the PyTorch wheels each DLC installs
(`pip install torch==X --index-url https://download.pytorch.org/whl/cuXYZ`, see the DLC Dockerfiles):

* PyTorch 2.6 cu126: 5.0 6.0 7.0 7.5 8.0 8.6 9.0                 (.ci/manywheel/build_cuda.sh, 12.6 case)
* PyTorch 2.7 cu128: 7.5 8.0 8.6 9.0 10.0 12.0+PTX — **no Volta**   (sm_50-sm_70 removed for CUDA 12.8)
* PyTorch 2.8 cu129: 7.0 7.5 8.0 8.6 9.0 10.0 12.0+PTX — Volta kept (pytorch/pytorch#157517; release/2.8
  build_cuda.sh "we would like to keep sm_70"; atalman in pytorch/pytorch#160269: "Volta is still supported
  for both CUDA 12.8 and 12.9 builds" of 2.8)
* PyTorch 2.9 / 2.10 cu130: 7.5 8.0 8.6 9.0 10.0 12.0+PTX — CUDA 13 dropped Maxwell/Pascal/Volta
  (RELEASE.md support matrix, pytorch/pytorch#164471)
* 2.11+: Volta also dropped from cu128 (pytorch/pytorch#172352); the new `pytorch` DLC family (AL2023,
  cu130/cu133) has no sm70 either.

So the newest DLC that still runs on V100 (ml.p3*, sm70) is `pytorch-training:2.8.0-gpu-py312-cu129-
ubuntu22.04-sagemaker` (end of patch 2026-08-06, DLC docs/src/data/pytorch-training/2.8-gpu-sagemaker.yml);
2.6.0 cu126 is the fallback. Everything sm75+ gets 2.10.0 (py313, cu130). The AL2023 `pytorch` family is
not used because its script-mode entry point (sagemaker_program) is not documented alongside it; pass
`--image` to use any other image.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import unknown

# Account that hosts the DLC repositories, per region (DLC available_images.md, "Region Availability").
DLC_ACCOUNTS: dict[str, str] = {
    "us-east-1": "763104351884", "us-east-2": "763104351884", "us-west-1": "763104351884",
    "us-west-2": "763104351884", "ap-south-1": "763104351884", "ap-northeast-1": "763104351884",
    "ap-northeast-2": "763104351884", "ap-southeast-1": "763104351884", "ap-southeast-2": "763104351884",
    "ap-east-2": "763104351884", "ca-central-1": "763104351884", "eu-central-1": "763104351884",
    "eu-west-1": "763104351884", "eu-west-2": "763104351884", "eu-west-3": "763104351884",
    "eu-north-1": "763104351884", "sa-east-1": "763104351884",
    "af-south-1": "626614931356", "ap-east-1": "871362719292", "ap-south-2": "772153158452",
    "ap-southeast-3": "907027046896", "ap-southeast-4": "457447274322", "ap-southeast-5": "550225433462",
    "ap-southeast-7": "590183813437", "ap-northeast-3": "364406365360", "ca-west-1": "204538143572",
    "eu-south-1": "692866216735", "eu-south-2": "503227376785", "eu-central-2": "380420809688",
    "il-central-1": "780543022126", "mx-central-1": "637423239942", "me-south-1": "217643126080",
    "me-central-1": "914824155844", "cn-north-1": "727897471807", "cn-northwest-1": "727897471807",
}
DLC_SOURCE = "https://github.com/aws/deep-learning-containers/blob/master/available_images.md"

Arch = tuple[int, int]


@dataclass(frozen=True)
class DlcImage:
    repository: str
    framework_version: str
    py_version: str
    cuda: str
    tag: str
    cuda_archs: tuple[Arch, ...]  # cubins in the PyTorch wheel
    ptx: Arch | None = None  # newest arch also shipped as PTX (JIT-compiles on newer GPUs)
    end_of_patch: str = ""
    source: str = ""

    def supports(self, cc: Arch) -> bool:
        """A cubin for (M, m') runs on (M, m) with m' <= m; PTX for (M, m') runs on anything >= it."""
        if any(a[0] == cc[0] and a[1] <= cc[1] for a in self.cuda_archs):
            return True
        return self.ptx is not None and cc >= self.ptx

    def uri(self, region: str) -> str:
        return f"{registry(region)}/{self.repository}:{self.tag}"


_ARCH_126: tuple[Arch, ...] = ((5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0))
_ARCH_128_27: tuple[Arch, ...] = ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))
_ARCH_129_28: tuple[Arch, ...] = ((7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))
_ARCH_130: tuple[Arch, ...] = ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))

# Newest first. Tags: DLC docs/src/data/pytorch-training/<ver>-gpu-sagemaker.yml.
PYTORCH_TRAINING_IMAGES: tuple[DlcImage, ...] = (
    DlcImage("pytorch-training", "2.10.0", "py313", "cu130", "2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker",
             _ARCH_130, ptx=(12, 0), end_of_patch="2027-01-21",
             source="DLC 2.10-gpu-sagemaker.yml; torch cu130 wheels: sm75+ (RELEASE.md matrix)"),
    DlcImage("pytorch-training", "2.9.0", "py312", "cu130", "2.9.0-gpu-py312-cu130-ubuntu22.04-sagemaker",
             _ARCH_130, ptx=(12, 0),
             source="DLC 2.9-gpu-sagemaker.yml; torch cu130 wheels: sm75+ (pytorch/pytorch#164471)"),
    DlcImage("pytorch-training", "2.8.0", "py312", "cu129", "2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker",
             _ARCH_129_28, ptx=(12, 0), end_of_patch="2026-08-06",
             source="DLC 2.8 Dockerfile installs torch 2.8.0 from whl/cu129; release/2.8 build_cuda.sh 12.9: "
                    "7.0;7.5;8.0;8.6;9.0;10.0;12.0+PTX (pytorch/pytorch#157517, #160269)"),
    DlcImage("pytorch-training", "2.7.1", "py312", "cu128", "2.7.1-gpu-py312-cu128-ubuntu22.04-sagemaker",
             _ARCH_128_27, ptx=(12, 0),
             source="DLC 2.7 Dockerfile installs torch 2.7.1 from whl/cu128; 2.7 cu128 wheels dropped sm50-sm70"),
    DlcImage("pytorch-training", "2.6.0", "py312", "cu126", "2.6.0-gpu-py312-cu126-ubuntu22.04-sagemaker",
             _ARCH_126, end_of_patch="2026-01-29",
             source="DLC 2.6-gpu-sagemaker.yml; torch cu126 wheels: 5.0;6.0;7.0;7.5;8.0;8.6;9.0"),
)


def registry(region: str) -> str:
    if region not in DLC_ACCOUNTS:
        raise unknown("--region", region, sorted(DLC_ACCOUNTS))
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{DLC_ACCOUNTS[region]}.dkr.ecr.{region}.{domain}"

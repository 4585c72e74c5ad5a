"""Which AWS Deep Learning Container (DLC) runs the probe on a given instance, in a given region.

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

from planner.dlc import DLC_ACCOUNTS, DLC_SOURCE, PYTORCH_TRAINING_IMAGES, Arch, DlcImage, registry  # noqa: F401
from planner.errors import PlannerError, unknown

# The DLC table is a fact of the core (planner/dlc.py); re-exported here for the launch code and its tests.

def compute_capability(instance_type: str) -> Arch:
    """The instance's GPU compute capability, from the hardware catalog (planner/data/gpus.json): a new GPU
    is a data row there, not a table here. An unknown instance is bad input naming the known ones."""
    from planner.hardware import get_instance

    return tuple(get_instance(instance_type).gpu.compute_capability)  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageChoice:
    uri: str
    framework_version: str
    py_version: str
    reason: str


def choose_image(instance_type: str, region: str, *, framework_version: str | None = None,
                 image_uri: str | None = None) -> ImageChoice:
    """The newest DLC whose PyTorch has kernels for the instance's GPU (or the one asked for)."""
    if image_uri:
        return ImageChoice(image_uri, framework_version or "custom", "", "given with --image")
    cc = compute_capability(instance_type)
    if framework_version:
        for img in PYTORCH_TRAINING_IMAGES:
            if img.framework_version == framework_version or img.framework_version.startswith(framework_version + "."):
                if not img.supports(cc):
                    raise PlannerError("--framework-version", framework_version,
                                       f"a version whose PyTorch build has sm{cc[0]}{cc[1]} kernels: "
                                       + ", ".join(i.framework_version for i in PYTORCH_TRAINING_IMAGES
                                                   if i.supports(cc)))
                return ImageChoice(img.uri(region), img.framework_version, img.py_version,
                                   f"asked for {framework_version}; {img.source}")
        sdk_uri = _sdk_image(framework_version, region, instance_type)
        if sdk_uri:
            return ImageChoice(sdk_uri, framework_version, "", "sagemaker.image_uris.retrieve (not arch-checked)")
        raise unknown("--framework-version", framework_version,
                      [i.framework_version for i in PYTORCH_TRAINING_IMAGES])
    for img in PYTORCH_TRAINING_IMAGES:
        if img.supports(cc):
            return ImageChoice(img.uri(region), img.framework_version, img.py_version,
                               f"newest DLC with kernels for sm{cc[0]}{cc[1]}: {img.source}")
    raise PlannerError("--instance", instance_type, f"an instance whose GPU (sm{cc[0]}{cc[1]}) a known DLC supports")


def _sdk_image(version: str, region: str, instance_type: str) -> str | None:
    """Ask the SageMaker Python SDK, if installed, for a version we do not list (a convenience only)."""
    try:
        from sagemaker import image_uris  # type: ignore[import-not-found]

        return image_uris.retrieve("pytorch", region=region, version=version, instance_type=instance_type,
                                   image_scope="training", py_version=None)
    except Exception:  # noqa: BLE001 - SDK missing or version unknown to it
        return None

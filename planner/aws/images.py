"""Which AWS Deep Learning Container (DLC) runs the probe on a given instance, in a given region.

The choice reads the DLC table of planner/dlc.py: which PyTorch build each DLC carries and the GPU
architectures its wheel has kernels for (the sources are in that module's docstring). An instance gets the
newest DLC whose wheel runs on its GPU's compute capability; `--image` uses any other image.
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

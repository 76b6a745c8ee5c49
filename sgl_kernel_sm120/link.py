"""Does this GPU have an active NVLink (for `link="auto"`)? A hint for the seed schedules only: a wrong answer costs
speed, never correctness, and any failure answers no (PCIe, the label that claims less)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def local_gpu_has_nvlink(device: torch.device) -> bool:
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        return True
                except pynvml.NVMLError:
                    break
            return False
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing, old driver, unknown UUID format: claim less
        logger.debug("NVLink probe failed (%s); assuming PCIe", exc)
        return False

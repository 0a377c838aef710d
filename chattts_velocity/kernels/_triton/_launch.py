"""Launch settings shared by the kernels."""

from __future__ import annotations

import functools
import os

import torch


def num_warps_for(elements: int) -> int:
    """Warps for a program that handles ``elements`` values: about 256 per warp, between 1 and 8."""
    return min(max(elements // 256, 1), 8)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs microseconds)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the decode kernels that support it: on Hopper and newer, unless
    ``CHATTTS_VELOCITY_PDL=0`` (a switch for comparisons, and for drivers that mishandle it). Such a kernel
    starts while the one before it finishes, reads before ``gdc_wait`` only what no kernel of the step writes
    (weights; the keys and values earlier steps cached) or what it may read stale, and lets the next kernel
    start at once (``gdc_launch_dependents``)."""
    if os.environ.get("CHATTTS_VELOCITY_PDL", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device_or_flag: torch.device | bool) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr: ``use_pdl`` for a device, or as forced."""
    on = device_or_flag if isinstance(device_or_flag, bool) else use_pdl(device_or_flag)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}

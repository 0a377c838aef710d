"""Launch settings shared by the kernels."""

from __future__ import annotations

import functools

import torch


def num_warps_for(elements: int) -> int:
    """Warps for a program that handles ``elements`` values: about 256 per warp, between 1 and 8."""
    return min(max(elements // 256, 1), 8)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs microseconds)."""
    return torch.cuda.get_device_properties(device).multi_processor_count

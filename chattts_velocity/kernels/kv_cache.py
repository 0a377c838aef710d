"""Writing this step's keys and values into the paged KV cache."""

from __future__ import annotations

from torch import Tensor

from ._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_contiguous,
    check_rows,
    check_same_device,
    check_tensor,
    is_power_of_two,
    use_triton,
)

CACHE_SHAPE = "[num_blocks, block_size, Hk, D]"


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k, v [N, Hk, D] into k_cache, v_cache [num_blocks, block_size, Hk, D] at ``slot_mapping`` [N].

    Slot = block_id * block_size + offset; a negative slot skips its token (padding). k and v may be strided
    views whose heads are contiguous in D.
    """
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    if use_triton(k):
        from ._triton.kv_cache import store_kv_triton

        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Torch reference of ``store_kv`` (the CPU path)."""
    keep = slot_mapping >= 0  # [N]
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def check_kv_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    """The cache layout every paged kernel assumes."""
    check_tensor("k_cache", k_cache, CACHE_SHAPE, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, CACHE_SHAPE, 4, (k_cache.dtype,))
    check(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                                          f"{tuple(k_cache.shape)}")
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    head_dim = k_cache.shape[3]
    check(is_power_of_two(head_dim), f"head_dim must be a power of two, got {head_dim}")


def check_store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    check_kv_cache(k_cache, v_cache)
    check_tensor("k", k, "[N, Hk, D]", 3, (k_cache.dtype,))
    check_tensor("v", v, "[N, Hk, D]", 3, (k_cache.dtype,))
    check(k.shape == v.shape, f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    check(k.shape[1:] == k_cache.shape[2:], f"k heads/dim {tuple(k.shape[1:])} != cache heads/dim "
                                            f"{tuple(k_cache.shape[2:])}")
    check_rows("k", k)
    check_rows("v", v)
    check_tensor("slot_mapping", slot_mapping, "[N]", 1, INDEX_DTYPES)
    check(slot_mapping.shape[0] == k.shape[0], f"slot_mapping has {slot_mapping.shape[0]} entries, k has "
                                               f"{k.shape[0]} tokens")
    check_contiguous("slot_mapping", slot_mapping)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)

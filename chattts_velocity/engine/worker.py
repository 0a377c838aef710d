"""``Worker``: owns the device side: the Llama core in the engine's dtype, the paged KV cache (sized from the
config and the device's memory) and the ``ModelRunner`` that runs every step on them."""

from __future__ import annotations

import logging

import torch

from ..model.llama import LlamaCore
from .config import EngineConfig
from .model_runner import ModelRunner, Window
from .sampler import Sampler
from .scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_KV_GIB = 1.0
_GPU_KV_FRACTION = 0.4


class Worker:
    def __init__(self, gpt, config: EngineConfig, spk_emb_id: int, text_eos_id: int, device: torch.device):
        gcfg = gpt.config
        self.device = device
        gpt.ensure_llama()  # (an engine built again over a model whose reference weights were let go)
        self.core = LlamaCore(gpt.llama, config.torch_dtype, device)
        head_dim = gcfg.hidden_size // gcfg.num_attention_heads
        self.block_shape = (config.block_size, gcfg.num_key_value_heads, head_dim)
        self.num_blocks = self._num_blocks(config, gcfg)
        shape = (self.num_blocks, *self.block_shape)
        self.kv_caches = [
            (torch.zeros(shape, dtype=config.torch_dtype, device=device),
             torch.zeros(shape, dtype=config.torch_dtype, device=device))
            for _ in range(gcfg.num_hidden_layers)
        ]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", self.num_blocks, config.block_size,
                    self.num_blocks * self._block_bytes(config, gcfg) / 2**30, config.dtype)
        sampler = Sampler(gpt.embed, gcfg.num_vq, gcfg.eos_code, text_eos_id)
        use_graphs = device.type == "cuda" and not config.enforce_eager
        with torch.no_grad():  # the audio codes' embedding table, one for the prefill steps and the windows
            codes = gpt.embed.fuse_code_tables()  # [Q * V, H], [Q]
        self.runner = ModelRunner(gpt, self.core, self.kv_caches, config.block_size, spk_emb_id, sampler, device,
                                  codes, config.max_num_seqs, config.num_decode_steps,
                                  gcfg.max_position_embeddings, use_graphs)

    def _block_bytes(self, config: EngineConfig, gcfg) -> int:
        per_token = 2 * gcfg.num_hidden_layers * gcfg.num_key_value_heads * (gcfg.hidden_size // gcfg.num_attention_heads)
        return per_token * config.block_size * torch.empty(0, dtype=config.torch_dtype).element_size()

    def _num_blocks(self, config: EngineConfig, gcfg) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_gib is not None:
            budget = config.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * _GPU_KV_FRACTION
        else:
            budget = _CPU_KV_GIB * 2**30
        blocks = int(budget // self._block_bytes(config, gcfg))
        if config.kv_cache_gib is None:  # automatic size: no more than max_num_seqs full contexts
            per_seq = -(-gcfg.max_position_embeddings // config.block_size)
            blocks = min(blocks, config.max_num_seqs * per_seq)
        if blocks < 1:
            raise ValueError(f"kv_cache_gib={config.kv_cache_gib} holds no KV block; give more memory")
        return blocks

    def launch(self, plan: SchedulerOutput) -> Window:
        """Queue a scheduled step (``ModelRunner.launch``)."""
        return self.runner.launch(plan)

    def launch_next(self, window: Window, num_steps: int) -> Window:
        """Queue the next decode window of ``window``'s batch behind it (``ModelRunner.launch_next``)."""
        return self.runner.launch_next(window, num_steps)

    def collect(self, window: Window) -> list[list[tuple[int, ...]]]:
        """Wait for a launched step: tokens[i][j] of sequence i at step j (hidden states: ``window.hidden``)."""
        return self.runner.collect(window)

"""``LLMEngine``: requests in, tokens out, one ``step`` at a time. Each step schedules a batch (decodes and
prefill chunks of any mix of requests and parameters), runs it, samples, and reports every request that
advanced, so streaming consumers follow each request incrementally."""

from __future__ import annotations

import hashlib
import itertools
import random

import torch

from .block_manager import BlockSpaceManager
from .config import EngineConfig
from .decode import Window
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import FinishReason, Prompt, RequestOutput, Sequence, SequenceGroup
from .worker import Worker


class LLMEngine:
    def __init__(self, gpt, config: EngineConfig, spk_emb_id: int, text_eos_id: int,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.model_config = gpt.config
        self.text_eos_id = text_eos_id
        self.worker = Worker(gpt, config, spk_emb_id, text_eos_id, torch.device(device))
        self.block_manager = BlockSpaceManager(self.worker.num_blocks, config.block_size, config.watermark,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.num_decode_steps)
        self.requests: dict[str, SequenceGroup] = {}
        self._aborted: list[RequestOutput] = []
        pipeline = config.pipeline_decode
        self._pipeline = self.worker.device.type == "cuda" if pipeline is None else pipeline
        self._window: Window | None = None
        """A decode window queued on the device whose tokens the next ``step`` reads."""
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model, config: EngineConfig | None = None, device: torch.device | str = "cpu") -> LLMEngine:
        """An engine over a loaded ChatTTS model (``ModelLoader.load``)."""
        tok = model.tokenizer
        return cls(model.gpt, config or EngineConfig(), tok.spk_emb_ids, tok.eos_token, device)

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request; raises ``ValueError`` (and changes nothing) if it can never be served."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, prompt, params)
        self.requests[request_id] = SequenceGroup(seq)
        self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Sequence:
        tokens, is_text = self.validate_request(prompt, params)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        speaker = None if prompt.speaker is None else prompt.speaker.detach().to(torch.float32).cpu()
        speaker_key = b"" if speaker is None else hashlib.blake2b(speaker.numpy().tobytes(), digest_size=16).digest()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        max_tokens = min(len(tokens) + params.max_new_tokens, self.max_model_len, capacity)
        return Sequence(next(self._ids), request_id, tokens, is_text, speaker, speaker_key, params, seed, max_tokens)

    def num_cached_prompt_tokens(self, prompt: Prompt) -> int:
        """How many leading tokens of ``prompt`` the prefix cache holds now (what admitting it would reuse)."""
        seq = self._new_sequence("", prompt, SamplingParams())
        return len(self.block_manager.lookup_prefix(seq)) * self.block_manager.block_size

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> tuple[list[tuple[int, ...]], list[bool]]:
        """Raise ``ValueError`` saying what to fix if the request can never be served; else its tokens."""
        params.validate(self.model_config.num_vq)
        tokens, is_text = self._check_prompt(prompt)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(tokens) >= min(self.max_model_len, capacity):
            limit = "the model's context" if self.max_model_len <= capacity else "the KV cache"
            raise ValueError(
                f"prompt of {len(tokens)} tokens leaves no room to generate: {limit} holds "
                f"{min(self.max_model_len, capacity)} tokens; shorten the prompt"
                + ("" if self.max_model_len <= capacity else " or give the engine more KV cache")
            )
        return tokens, is_text

    def _check_prompt(self, prompt: Prompt) -> tuple[list[tuple[int, ...]], list[bool]]:
        cfg = self.model_config
        ids, mask = prompt.ids, prompt.text_mask
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.size(1) != cfg.num_vq or ids.is_floating_point():
            raise ValueError(f"prompt.ids must be an integer tensor [T, num_vq={cfg.num_vq}], got "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")
        if ids.size(0) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape[:1] or mask.dtype != torch.bool:
            raise ValueError(f"prompt.text_mask must be a bool tensor [{ids.size(0)}], got "
                             f"{getattr(mask, 'shape', type(mask).__name__)}")
        ids, mask = ids.cpu(), mask.cpu()
        for name, sel, limit in (("text", mask, cfg.num_text_tokens), ("audio", ~mask, cfg.num_audio_tokens)):
            bad = ids[sel]
            if bad.numel() and (bad.min() < 0 or bad.max() >= limit):
                raise ValueError(f"prompt has {name} ids outside [0, {limit})")
        spk = prompt.speaker
        if spk is not None and (not isinstance(spk, torch.Tensor) or spk.shape != (cfg.hidden_size,)
                                or not spk.is_floating_point() or not torch.isfinite(spk).all()):
            raise ValueError(f"prompt.speaker must be None or a finite float tensor [{cfg.hidden_size}]")
        return [tuple(t) for t in ids.tolist()], mask.tolist()

    def abort_request(self, request_id: str, report: bool = True) -> bool:
        """Stop a request now and free its blocks; unless ``report`` is False, the next ``step`` reports it
        finished with ``abort``. Returns False if the request is unknown or already finished."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return False
        self.scheduler.finish(group.seq, FinishReason.ABORT)
        if report:
            self._aborted.append(self._output(group))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Run one batch; report every request that sampled a token, finished or was aborted since.

        Audio decode windows are pipelined: while the batch stays the same (nobody waiting, nobody finished),
        the next window is queued on the device before this one's tokens are read back and processed, so the
        host work overlaps the device's."""
        outputs, self._aborted = self._aborted, []
        window, self._window = self._window, None
        if window is None:
            plan = self.scheduler.schedule()
            if not plan.scheduled:
                return outputs
            if plan.num_steps > 1:
                window = self.worker.launch_window([item.seq for item in plan.scheduled], plan.num_steps)
        if window is not None:
            self._window = self._continue(window)
            tokens = self.worker.collect_window(window)
            sampled = []
            for seq, seq_tokens, seq_hidden in zip(window.seqs, tokens, window.hidden.unbind(1), strict=True):
                if not seq.is_finished:  # not aborted while its window ran
                    sampled.append(seq)
                    self._accept(seq, seq_tokens, seq_hidden)
        else:
            result = self.worker.execute(plan.scheduled)
            for item in plan.scheduled:  # the last token of a sampling sequence is counted by _accept
                item.seq.num_computed_tokens += item.num_new_tokens - item.samples
                self.block_manager.cache_full_blocks(item.seq)
            sampled = result.seqs
            for i, seq in enumerate(sampled):
                self._accept(seq, [result.tokens[i]], result.hidden[i : i + 1])
        for seq in sampled:
            outputs.append(self._output(self.requests[seq.request_id]))
            if seq.is_finished:
                del self.requests[seq.request_id]
        return outputs

    def _continue(self, window: Window) -> Window | None:
        """Queue the same batch's next window behind ``window`` if nothing can change the batch before it: no
        request waiting, every sequence still running and none reaching its length limit inside ``window``, and
        free blocks for everyone's next window (counted past ``window``'s tokens, which are not appended yet).
        A sequence that ends by EOS inside ``window`` computes the queued window in vain; its tokens are
        dropped and the pipeline stops there."""
        sched, bm, k = self.scheduler, self.block_manager, self.config.num_decode_steps
        if not self._pipeline or sched.waiting or len(sched.running) != len(window.seqs):
            return None
        ahead = window.num_steps
        wanted = []
        for seq in window.seqs:
            if seq.is_finished or len(seq) + ahead >= seq.max_tokens:
                return None
            wanted.append(ahead + min(k, seq.max_tokens - len(seq) - ahead))
        needed = sum(max(bm.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table), 0)
                     for seq, n in zip(window.seqs, wanted, strict=True))
        if needed > bm.num_free_blocks:
            return None
        for seq, n in zip(window.seqs, wanted, strict=True):
            bm.allocate(seq, n)
        return self.worker.launch_window(window.seqs, k, continuing=True)

    def _accept(self, seq: Sequence, tokens: list[tuple[int, ...]], hidden: torch.Tensor) -> None:
        """Append sampled tokens until EOS or the length limit; every accepted step computed one more token."""
        eos = self.text_eos_id if seq.text_mode else self.model_config.eos_code
        # any codebook's EOS ends it (a text token repeats its id over the codebooks)
        ends = next((i for i, token in enumerate(tokens) if eos in token), len(tokens))
        room = seq.max_tokens - len(seq)
        hit_eos = ends < min(len(tokens), room)  # an EOS past the length limit is never seen
        taken = ends if hit_eos else min(len(tokens), room)
        seq.num_computed_tokens += taken + hit_eos  # the EOS step computed a token too
        seq.extend(tokens[:taken])
        reason = FinishReason.EOS if hit_eos else FinishReason.LENGTH if taken == room else None
        if taken and seq.params.return_hidden_states:
            seq.hidden_chunks.append(hidden[:taken])
        self.block_manager.cache_full_blocks(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        seq, start = group.seq, group.num_reported
        group.num_reported = seq.num_generated
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.output_ids(start),
            new_hidden_states=seq.output_hidden(self.model_config.hidden_size, start),
            num_generated=seq.num_generated,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
        )
        if seq.is_finished:
            out.token_ids = seq.output_ids()
            out.hidden_states = seq.output_hidden(self.model_config.hidden_size)
        return out

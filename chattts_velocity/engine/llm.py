"""``LLM``: offline generation over ``LLMEngine``: submit everything, step until done, return in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import torch
from tqdm import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import Prompt, RequestOutput


class LLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model, config: EngineConfig | None = None, device: torch.device | str = "cpu") -> LLM:
        return cls(LLMEngine.from_model(model, config, device))

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """The final output of every prompt, in order. ``params`` is one for all or one per prompt. Requests
        are validated before any is queued, so a bad one leaves the engine untouched."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                self.engine.validate_request(prompt, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.engine.add_request(rid, prompt, p)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            try:
                while len(done) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in wanted - done.keys():
                    self.engine.abort_request(rid)
                raise
        return [done[rid] for rid in ids]

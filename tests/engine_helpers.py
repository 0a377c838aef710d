"""Small builders for engine unit tests: sequences without a model."""

from __future__ import annotations

import itertools

from chattts_velocity.engine.model_runner import OpenWindow
from chattts_velocity.engine.sampling_params import SamplingParams
from chattts_velocity.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(num_tokens: int, first: int = 0, speaker_key: bytes = b"", max_new: int = 100,
             request_id: str | None = None) -> Sequence:
    """A code-mode sequence of ``num_tokens`` distinct audio tokens starting at id ``first``."""
    tokens = [(first + i,) * 4 for i in range(num_tokens)]
    seq_id = next(_ids)
    return Sequence(seq_id, request_id or f"r{seq_id}", tokens, [False] * num_tokens, None, speaker_key,
                    SamplingParams(max_new_tokens=max_new), seed=0, max_tokens=num_tokens + max_new)


def record_windows(engine, record) -> None:
    """Call ``record(window, continuing)`` for every decode window ``engine`` launches (``continuing``: queued
    behind the batch's previous window by ``ModelRunner.launch_next``); an ``OpenWindow`` when it is opened."""
    runner = engine.runner
    launch, launch_next, open_window = runner.launch, runner.launch_next, runner.open

    def first(plan):
        window = launch(plan)
        if window.decode:
            record(window, False)
        return window

    def opened(plan, lead):
        window = open_window(plan, lead)  # launched whole (through ``first``) or open
        if isinstance(window, OpenWindow):
            record(window, False)
        return window

    def following(window, num_steps, lead=None):
        queued = launch_next(window, num_steps, lead)
        record(queued, True)
        return queued

    runner.launch, runner.launch_next, runner.open = first, following, opened

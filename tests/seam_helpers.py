"""Checks shared by the engine-seam tests (a ``LocalClient`` in this process, a ``RemoteClient`` over pipes)."""

from __future__ import annotations

import asyncio

import pytest

from chattts_velocity.params import RefineTextParams


def engine_is_idle(chat) -> bool:
    """Every request of ``chat``'s engine finished or aborted, and its KV blocks given back."""
    assert chat.engine.wait_idle(timeout=30)
    stats = chat.engine.stats().engine
    return stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def check_cancelled_refine_aborts(client, chat) -> None:
    """A refine pass through ``client`` whose awaiting task is cancelled once it runs: the task ends cancelled,
    and ``chat``'s engine aborted its request (idle, fewer tokens generated than the pass would have)."""
    before = chat.engine.stats().engine.num_generated_tokens

    async def cancelled() -> None:
        slow = RefineTextParams(manual_seed=1, max_new_token=384, min_new_token=384, show_tqdm=False)
        task = asyncio.ensure_future(client.refine(["a refine pass that is cancelled"], slow))
        while chat.engine.stats().engine.num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert engine_is_idle(chat)
    assert chat.engine.stats().engine.num_generated_tokens - before < 384  # aborted, not run to its end

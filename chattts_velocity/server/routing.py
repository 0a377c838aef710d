"""Routing speech requests over Ray Serve replicas by their engines' load (``EngineLoadRouter``).

A streaming speech request holds its replica's engine for as long as its audio lasts, and all of a replica's
streams share that engine's steps: the replica to send a request to is the one whose engine has the fewest
streams, unless its KV cache is nearly full (a new request would wait there for blocks, or make the engine
preempt one). Serve's default router compares two replicas drawn at random by requests in flight; this one ranks
every replica: first those with KV room, then by the requests in flight there (the router's own count, or what
the replica last reported if that is more: another proxy's requests), then by the engine's sequences as the
replica last reported them (``record_routing_stats``, every ``request_routing_stats_period_s``). Serve takes the first replica in that order
that has room (``max_ongoing_requests``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..engine import EngineStats

KV_FULL = 0.9
"""A replica whose engine's KV cache is at least this full goes after every replica with room."""

CHOICE_TTL_S = 1.0
"""How long a choice counts as a request to its replica before the send (or without one)."""

R = TypeVar("R")


def routing_stats(engine: EngineStats, admitted: int) -> dict:
    """What a replica reports for routing: its engine's sequences and KV use, and its admitted speech requests
    (running or queued at the replica)."""
    total = max(engine.kv_blocks_total, 1)
    return {"sequences": engine.num_running + engine.num_waiting, "kv_used": engine.kv_blocks_used / total,
            "admitted": admitted}


def rank_by_load(replicas: Sequence[R], in_flight: Callable[[R], int | None],
                 stats: Callable[[R], Mapping], shuffle: Callable[[], float] = random.random) -> list[R]:
    """``replicas`` from the least loaded to the most: KV room first, then fewer requests in flight
    (``in_flight``; None: unknown, the replica's reported ``admitted`` instead), then fewer engine sequences;
    ties in random order (``shuffle``), so that equal replicas share a burst."""

    def key(replica: R) -> tuple:
        reported = stats(replica) or {}
        count = in_flight(replica)
        if count is None:
            count = reported.get("admitted", 0)
        return reported.get("kv_used", 0.0) >= KV_FULL, count, reported.get("sequences", 0), shuffle()

    return sorted(replicas, key=key)


class EngineLoadRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the speech replicas (see the module). It counts its own requests per replica,
    from the choice to the end of the response (a stream's last byte, or a refusal): Serve's cache of a
    replica's ongoing requests is overwritten by each accepted request's answer, which in a burst still counts
    fewer than were sent, and several routing tasks choose at once before any of them sends. A choice that
    was not followed by a send to that replica (it was full: Serve took the next) stops counting after
    ``CHOICE_TTL_S``."""

    def initialize_state(self, **kwargs) -> None:
        self._in_flight: dict[ReplicaID, int] = {}  # sent, not completed
        self._chosen: dict[ReplicaID, list[float]] = {}  # when each choice not yet sent was made

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        if self._chosen.get(replica_id):
            self._chosen[replica_id].pop(0)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        left = self._in_flight.get(replica_id, 0) - 1
        if left > 0:
            self._in_flight[replica_id] = left
        else:
            self._in_flight.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        now = time.monotonic()
        for replica_id, times in list(self._chosen.items()):
            self._chosen[replica_id] = [t for t in times if now - t < CHOICE_TTL_S]

        def in_flight(replica: RunningReplica) -> int:
            mine = self._in_flight.get(replica.replica_id, 0) + len(self._chosen.get(replica.replica_id, ()))
            # other routers' requests (another node's proxy) appear in what the replica reports
            return max(mine, (replica.routing_stats or {}).get("admitted", 0))

        ranked = rank_by_load(candidate_replicas, in_flight, lambda r: r.routing_stats)
        if ranked:
            self._chosen.setdefault(ranked[0].replica_id, []).append(now)
        return [[replica] for replica in ranked]

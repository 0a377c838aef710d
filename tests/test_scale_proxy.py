"""``serve --replicas 2 --ingress proxy``: Serve's Python proxy relays every request through Ray, and
``routing.EngineLoadRouter`` chooses each request's replica. The tests of ``test_scale.py`` that depend on the
ingress run here again over this server: a burst spreads evenly (Serve's default router sends a burst's requests to
a replica that already has the most at times), streaming through the ``openai`` SDK, the realtime socket, and a
full replica's 429."""

from __future__ import annotations

import pytest
from test_scale import (  # noqa: F401 - collected here again, over this module's server
    client,
    scale_server,
    test_a_burst_fills_both_replicas_evenly_before_either_refuses,
    test_a_full_replica_answers_429_with_openais_error_body_and_retry_after,
    test_openai_sdk_streams_the_single_process_servers_audio,
    test_the_realtime_socket_works_through_serves_proxy,
)


@pytest.fixture(scope="module")
def server(upstream_ckpt, tmp_path_factory):
    with scale_server("proxy", upstream_ckpt, tmp_path_factory.mktemp("scale_proxy") / "server.log") as srv:
        yield srv


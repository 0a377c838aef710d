"""The speech server on Ray Serve: ``chattts-velocity serve --replicas 2`` joins a local Ray cluster that has two
logical GPUs (one replica each, on the CPU, over a tiny checkpoint). Through Serve's proxy the ``openai`` SDK
streams the same audio as the single-process server; requests spread over both replicas; voices and metrics are
shared; a disconnect frees the blocks on the replica that served it; Serve's queue answers 429 with
``Retry-After``; a killed replica fails only its own streams and is replaced. Loopback only, every wait bounded."""

from __future__ import annotations

import concurrent.futures
import io
import os
import signal
import threading
import time
from collections import defaultdict

# Before Ray is imported: its processes then bind and talk on 127.0.0.1 only (the variable makes Ray take the
# loopback address as the node's, as it does on macOS), and it reports no usage statistics.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import soundfile as sf  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_helpers import API_KEY, ServerProcess  # noqa: E402

from chattts_velocity.server.scale import APP_NAME, REPLICA_HEADER, application  # noqa: E402
from chattts_velocity.server.settings import ScaleConfig  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Hello there. This is a test of the speech server."
LONG = " ".join(f"Sentence number {i} keeps this request generating for a while." for i in range(30))
LONGER = " ".join(f"Sentence number {i} keeps this request generating for a while." for i in range(100))
"""Still generating seconds after its first audio, so that a per-replica snapshot (sent every second) sees its
blocks in use: the tiny CPU engine got through ``LONG`` before a snapshot once its decode got faster."""
SPEECH = "/v1/audio/speech"
STREAMED = " ".join(f"Sentence number {i} keeps this request generating for a while." for i in range(6))
"""Long enough that its audio leaves the replica as several chunks: ``TEXT``'s two sentences were done on the
tiny CPU engine before Serve's proxy sent the first, and twice in five CI runs arrived as one chunk."""


def body(text: str = TEXT, seed: int = 7, **kw) -> dict:
    return {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", "seed": seed, **kw}


def wait_for(check, timeout: float, what: str, period: float = 0.25):
    """``check()`` until it returns something truthy (returned), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def per_replica(url: str) -> dict[str, dict[str, float]]:
    """``GET /metrics`` as {replica: {sample: value}}; a sample's other labels are part of its key."""
    text = httpx.get(url + "/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a metric family appears twice"
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in families:
        for s in family.samples:
            labels = dict(s.labels)
            replica = labels.pop("replica")
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[replica][key] = s.value
    return dict(out)


def settled(url: str) -> dict[str, dict[str, float]]:
    """Metrics once every replica has reported since the last request (they report every second)."""
    time.sleep(1.3)
    return per_replica(url)


def ok_count(metrics: dict[str, float]) -> float:
    return metrics.get(f"chattts_requests_total{{route={SPEECH},status=200}}", 0.0)


@pytest.fixture(scope="module")
def ray_address():
    """This process starts the cluster (and can kill replicas): two logical GPUs, a small object store."""
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs its own in the driver
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024**2)
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    yield address
    ray.shutdown()
    signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture(scope="module")
def server(ray_address, upstream_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("scale") / "server.log"
    srv = ServerProcess(upstream_ckpt, "--replicas", "2", "--ray-address", ray_address, "--gpus-per-replica", "1",
                        "--max-new-token", "48", "--max-concurrent", "2", "--max-queue", "8",
                        "--max-input-chars", "8000", log_path=str(log))
    try:
        wait_for(lambda: len(per_replica(srv.url)) == 2, 150, "both replicas reporting metrics", period=1)
    except BaseException:
        srv.stop()
        raise
    yield srv
    assert srv.stop(60) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(url: str, payload: dict) -> httpx.Response:
    return httpx.post(url + SPEECH, headers=AUTH, json=payload, timeout=120)


# ------------------------------------------------------------------ without a cluster


def test_scale_config_is_validated():
    for bad in (dict(replicas=0), dict(min_replicas=1), dict(min_replicas=3, max_replicas=2),
                dict(min_replicas=0, max_replicas=2), dict(gpus_per_replica=-1), dict(target_ongoing_requests=0)):
        with pytest.raises(ValueError):
            ScaleConfig(**bad)
    assert ScaleConfig(min_replicas=1, max_replicas=4).autoscaling


def test_serve_options_and_app_builder_arguments_build_one_application(upstream_ckpt):
    from chattts_velocity.cli import build_parser, serve_settings
    from chattts_velocity.server import ServerConfig
    from chattts_velocity.server.scale import app_builder
    from chattts_velocity.server.settings import ServeSettings, parse_options

    settings = serve_settings(build_parser().parse_args([
        "serve", "--model", upstream_ckpt, "--device", "cpu", "--min-replicas", "1", "--max-replicas", "3",
        "--max-concurrent", "8"]))
    scale, server, load = settings.scale, settings.server, settings.load
    assert scale.autoscaling and (scale.min_replicas, scale.max_replicas) == (1, 3)
    assert scale.gpus_per_replica == 0  # CPU replicas unless asked for GPUs
    assert load == dict(source="custom", custom_path=upstream_ckpt, device="cpu", max_num_seqs=32, kv_cache_gib=None,
                        engine_dtype=None, max_window_tokens=2048)
    assert server.max_concurrent == 8
    # the same options as serve run's key=value arguments: the same settings
    options = {"model": upstream_ckpt, "device": "cpu", "min_replicas": "1", "max_replicas": "3", "max_concurrent": "8"}
    assert ServeSettings.from_options(parse_options(options)) == settings
    application(scale, server, load)  # Serve accepts every option
    assert application(ScaleConfig(), ServerConfig(), load) is not None
    assert app_builder({"model": upstream_ckpt, "replicas": "2", "dummy": "false"}) is not None
    with pytest.raises(ValueError, match="unknown option 'no_such_option'"):  # named, as on the command line
        app_builder({"no_such_option": "1"})
    with pytest.raises(ValueError, match="dummy is a flag"):
        app_builder({"dummy": "yes"})


def test_the_board_forgets_replicas_that_stop_reporting_and_renders_each_labelled():
    from types import SimpleNamespace

    from chattts_velocity.server.cluster import MetricsBoard
    from chattts_velocity.server.metrics import Metrics, labelled

    def stats(kv_used: int) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0, num_running=1, kv_blocks_used=kv_used, kv_blocks_total=64,
                               num_preemptions=0, num_generated_tokens=10)

    def metrics(replica: str) -> Metrics:
        return Metrics(SimpleNamespace(waiting=0, running=1), labels={"replica": replica})

    board = MetricsBoard(stale_s=0.2)
    board.report("a", metrics("a").collect(stats(3)))
    time.sleep(0.3)
    board.report("b", metrics("b").collect(stats(5)))
    board.report("c", metrics("c").collect(stats(7)))
    board.forget("c")
    snapshot = board.snapshot()
    assert set(snapshot) == {"b"}  # a went quiet, c left
    # replica a's /metrics: its own series and the others' (``ReplicaLink.peers``), each labelled
    peers = [labelled(families, {"replica": r}) for r, families in snapshot.items()]
    text = metrics("a").render(stats(3), peers)[0].decode()
    families = [f.name for f in text_string_to_metric_families(text)]
    assert len(families) == len(set(families))
    assert 'chattts_kv_blocks_used{replica="a"} 3.0' in text and 'chattts_kv_blocks_used{replica="b"} 5.0' in text


# ------------------------------------------------------------------ through Serve's proxy


def test_openai_sdk_streams_the_single_process_servers_audio(client, chat):
    from fastapi.testclient import TestClient

    from chattts_velocity.server import ServerConfig, build_app
    from chattts_velocity.serving.local import LocalClient

    with TestClient(build_app(LocalClient(chat), ServerConfig(max_new_token=48))) as single:
        alone = single.post(SPEECH, json=body(STREAMED))
    assert alone.status_code == 200 and len(alone.content) > 2 * 24000 * 0.2
    chunks = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=STREAMED,
                                                            response_format="pcm", extra_body={"seed": 7}) as r:
        assert r.headers[REPLICA_HEADER]
        chunks = list(r.iter_bytes(chunk_size=None))
    assert len(chunks) > 1, "not streamed"
    assert abs(sum(map(len, chunks)) - len(alone.content)) / 2 / 24000 < 1e-3


def test_requests_spread_over_both_replicas_and_metrics_count_each(server):
    before = settled(server.url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda seed: post(server.url, body(seed=seed)), range(6)))
    assert [r.status_code for r in responses] == [200] * 6
    served = [r.headers[REPLICA_HEADER] for r in responses]
    assert set(served) == set(before), served
    after = settled(server.url)
    for replica in before:
        assert ok_count(after[replica]) - ok_count(before[replica]) == served.count(replica)
        assert after[replica]["chattts_kv_blocks_total"] > 0


def test_a_voice_registered_through_one_replica_is_usable_through_all(server, client):
    sample_text = "A voice to clone. It speaks a few sentences. So the sample is long enough. To be useful."
    pcm = client.audio.speech.create(model="tts-1", voice="nova", input=sample_text, response_format="pcm",
                                     extra_body={"seed": 3}).content
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm, dtype="<i2"), 24000, format="WAV")
    r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH, data={"transcript": sample_text, "name": "mine"},
                   files={"audio": ("sample.wav", wav.getvalue(), "audio/wav")}, timeout=60)
    assert r.status_code == 201, r.text
    vid, registered_on = r.json()["id"], r.headers[REPLICA_HEADER]
    used_on, listed_on = set(), set()
    for _ in range(8):  # pairs of concurrent requests: the proxy sends them to different replicas
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(lambda _: post(server.url, body("spoken in my voice", voice={"id": vid})),
                                      range(2)))
        assert all(r.status_code == 200 and len(r.content) > 2 * 2400 for r in responses), [r.text for r in responses]
        used_on |= {r.headers[REPLICA_HEADER] for r in responses}
        voices = httpx.get(server.url + "/v1/audio/voices", headers=AUTH, timeout=30)
        assert vid in {v["id"] for v in voices.json()["voices"]}
        listed_on.add(voices.headers[REPLICA_HEADER])
        if len(used_on) == 2 and len(listed_on) == 2:
            break
    assert len(used_on) == 2 and registered_on in used_on, (used_on, registered_on)


def test_a_disconnect_frees_the_blocks_on_the_replica_that_served_it(server):
    before = settled(server.url)
    with httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(LONGER), timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers[REPLICA_HEADER]
        chunks = r.iter_raw()
        next(chunks)

        def generating() -> bool:
            next(chunks)  # keep reading: the request must still be running when we leave
            return per_replica(server.url)[replica]["chattts_kv_blocks_used"] > 0

        wait_for(generating, 20, "the serving replica's blocks in use", period=0)
    # the connection is closed: the proxy cancels the replica's request, which aborts its engine requests

    def freed():
        m = per_replica(server.url)[replica]
        return m["chattts_kv_blocks_used"] == 0 and m["chattts_running_requests"] == 0 and m

    after = wait_for(freed, 15, "the blocks freed")
    assert after["chattts_time_to_first_audio_seconds_count"] == \
        before[replica]["chattts_time_to_first_audio_seconds_count"] + 1
    assert after["chattts_real_time_factor_count"] == before[replica]["chattts_real_time_factor_count"], \
        "the request ran to its end instead of being aborted"


def test_beyond_the_replicas_slots_and_serves_queue_is_429_with_retry_after(server):
    """Each replica takes 2 running + HEADROOM requests and the proxy queues up to 8 more: of 32 at once, some
    are refused at once (how many depends on how fast the others finish, and in a burst Serve may refuse a
    little early), every other one succeeds, and the server recovers."""
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda seed: post(server.url, body(seed=seed)), range(32)))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and refused.text
    assert post(server.url, body()).status_code == 200


def test_a_killed_replica_fails_only_its_streams_and_serve_replaces_it(server):
    results: dict[int, tuple] = {}
    serving: list[str] = []
    started = threading.Semaphore(0)

    def stream(seed: int) -> None:
        replica = None
        try:
            with httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(LONG, seed), timeout=60) as r:
                replica = r.headers.get(REPLICA_HEADER)
                serving.append(replica)
                started.release()
                size = sum(len(c) for c in r.iter_raw())
            results[seed] = (replica, r.status_code, size)
        except httpx.HTTPError as e:
            results[seed] = (replica, "error", e)
        finally:
            if replica is None:
                started.release()

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    assert len(serving) == 4 and None not in serving, results
    victim = serving[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#SpeechServer#{victim}", namespace="serve"), no_restart=True)
    survivor_answer = post(server.url, body(seed=11))  # the other replica keeps serving meanwhile
    for t in threads:
        t.join(90)
    assert survivor_answer.status_code == 200 and survivor_answer.headers[REPLICA_HEADER] != victim
    assert len(results) == 4
    for replica, status, outcome in results.values():
        if replica == victim:  # a broken body, never a short one that looks complete
            assert status == "error" and isinstance(outcome, httpx.RemoteProtocolError), (status, outcome)
        else:
            assert status == 200 and outcome > 0, (status, outcome)

    def replaced():
        replicas = set(per_replica(server.url))
        return len(replicas) == 2 and victim not in replicas and replicas

    replicas = wait_for(replaced, 150, "Serve to replace the killed replica", period=1)
    seen = set()
    for _ in range(5):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(lambda seed: post(server.url, body(seed=seed)), range(3)))
        assert [r.status_code for r in responses] == [200] * 3
        seen |= {r.headers[REPLICA_HEADER] for r in responses}
        if seen == replicas:
            break
    assert seen == replicas, (seen, replicas)


def test_bench_serve_drives_the_replicas(server):
    """What the scale-out measurement (docs/perf/scale.md) runs on two GPUs, here on two CPU replicas."""
    from chattts_velocity.bench.serve import ServeBenchConfig, run_and_report

    rows = run_and_report(ServeBenchConfig(url=server.url, streams=(1, 4), requests_per_stream=1, api_key=API_KEY,
                                           json_path=None))["rows"]
    assert [r["streams"] for r in rows] == [1, 4] and all(r["failures"] == 0 for r in rows)
    # 4 streams at once on two engines produce more audio per second of wall time than 1 stream on one
    assert rows[1]["rtf_total"] > rows[0]["rtf_total"] > 0


def test_sigterm_lets_the_streams_in_flight_finish_and_exits_0(server):
    whole = len(post(server.url, body(LONG, 5)).content)
    with httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(LONG, 5), timeout=60) as r:
        chunks = r.iter_raw()
        size = len(next(chunks))
        server.terminate()
        # new requests are refused while the replicas drain: Serve's proxy has dropped the application's route
        wait_for(lambda: post(server.url, body()).status_code == 404, 20, "new requests refused", period=0.1)
        size += sum(len(c) for c in chunks)
    assert r.status_code == 200 and size == whole
    assert server.proc.wait(90) == 0

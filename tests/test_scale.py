"""The speech server on Ray Serve: ``chattts-velocity serve --replicas 2`` joins a local Ray cluster that has two
logical GPUs (one replica each, on the CPU, over a tiny checkpoint). Through Serve's proxy the ``openai`` SDK
streams the same audio as the single-process server; requests spread over both replicas; voices and metrics are
shared; a disconnect frees the blocks on the replica that served it; a full replica answers 429 with OpenAI's error
body and ``Retry-After``; a killed replica fails only its own streams and is replaced; SIGTERM drains (503, as a lone
server) while the streams in flight finish. Loopback only, every wait bounded and on the condition itself, never on
a sleep: a replica's values are read from its own ``/metrics`` answer (``own_metrics``), or from another replica's
view of them (as old as its last report) only once that view shows the event that the test waits for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

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
from realtime_helpers import Heard, assert_same_samples, hear, http_pcm, next_event, open_session, send, speak  # noqa: E402
from server_helpers import (  # noqa: E402
    API_KEY,
    ServerProcess,
    listening_pids,
    listening_ports,
    processes,
    socket_inodes,
    spawned,
)

from chattts_velocity.server.replica_fronts import FRONT_HEADER, REPLICA_HEADER  # noqa: E402
from chattts_velocity.server.scale import APP_NAME, application  # noqa: E402
from chattts_velocity.server.settings import DIRECT_INGRESS_ENV, HAPROXY_ENV, HAPROXY_RETRY_ENV, ScaleConfig  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
KUBERAY = Path(__file__).resolve().parent.parent / "examples" / "kuberay"
TEXT = "Hello there. This is a test of the speech server."
LONG = " ".join(f"Sentence number {i} keeps this request generating for a while." for i in range(30))
HELD = " ".join(f"Sentence number {i} keeps this request generating for a while." for i in range(1000))
"""Generates for far longer than any test holds it open, however fast or busy the machine: a stream of it keeps its
replica's running slot (its blocks in use) or its queue place until the test closes it."""
SPEECH = "/v1/audio/speech"
MAX_CONCURRENT, MAX_QUEUE = 2, 4
"""Each replica's limits (``--max-concurrent``, ``--max-queue``): it admits their sum of speech requests, then 429.
One replica alone admits every burst the tests send at once: Serve's proxy spreads a burst unevenly at times."""
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


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """A ``/metrics`` exposition as {replica: {sample: value}}; a sample's other labels are part of its key."""
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


def per_replica(url: str) -> dict[str, dict[str, float]]:
    """``GET /metrics`` as {replica: {sample: value}}: the answering replica's own values, the others' as they
    last reported (up to a report period old, and gone once a replica stops reporting)."""
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def own_metrics(url: str, replicas=None, timeout: float = 60) -> dict[str, dict[str, float]]:
    """{replica: {sample: value}} for each of ``replicas`` (default: every replica ``/metrics`` shows), each read
    from a ``/metrics`` that this replica answered itself: its values now, not as last reported. Serve's proxy
    sends each request to either replica, so this asks until each has answered."""
    seen: dict[str, dict[str, float]] = {}
    wanted = set(replicas or ())

    def each_answered():
        r = httpx.get(url + "/metrics", timeout=30)
        everyone = parse_metrics(r.text)
        seen[r.headers[REPLICA_HEADER]] = everyone[r.headers[REPLICA_HEADER]]
        wanted.update(() if replicas else everyone)
        return wanted <= set(seen) and {replica: seen[replica] for replica in wanted}

    return wait_for(each_answered, timeout, f"/metrics answered by each of {sorted(wanted) or 'the replicas'}",
                    period=0)


def ok_count(metrics: dict[str, float]) -> float:
    return metrics.get(f"chattts_requests_total{{route={SPEECH},status=200}}", 0.0)


@contextlib.contextmanager
def ray_cluster(ingress: str):
    """This process starts the cluster (and can kill replicas): two logical GPUs, a small object store; with
    ``ingress`` haproxy, Ray Serve's HAProxy switches in its processes' environment, as a cluster's nodes have
    them for ``--ingress haproxy``."""
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs its own in the driver
    switches = {HAPROXY_ENV: "1", DIRECT_INGRESS_ENV: "1", HAPROXY_RETRY_ENV: "conn-failure empty-response"} \
        if ingress == "haproxy" else {}
    with pytest.MonkeyPatch.context() as env:
        for name in (HAPROXY_ENV, DIRECT_INGRESS_ENV, HAPROXY_RETRY_ENV):
            env.delenv(name, raising=False)
        for name, value in switches.items():
            env.setenv(name, value)
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 * 1024**2)
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    try:
        yield address
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


@contextlib.contextmanager
def scale_server(ingress: str, ckpt: str, log: Path):
    """``serve --replicas 2 --ingress INGRESS`` on its own cluster, both replicas reporting; with HAProxy, two
    HTTP fronts per replica."""
    fronts = ("--fronts", "2") if ingress == "haproxy" else ()
    with ray_cluster(ingress) as address:
        srv = ServerProcess(ckpt, "--replicas", "2", "--ray-address", address, "--gpus-per-replica", "1",
                            "--ingress", ingress, *fronts, "--max-new-token", "48", "--max-concurrent", str(MAX_CONCURRENT),
                            "--max-queue", str(MAX_QUEUE), "--max-input-chars", str(len(HELD)), log_path=str(log),
                            ready_timeout=300)
        try:
            wait_for(lambda: len(per_replica(srv.url)) == 2, 150, "both replicas reporting metrics", period=1)
        except BaseException:
            srv.stop()
            raise
        yield srv
        assert srv.stop(60) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(upstream_ckpt, tmp_path_factory):
    with scale_server("haproxy", upstream_ckpt, tmp_path_factory.mktemp("scale") / "server.log") as srv:
        yield srv


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


def test_serve_options_and_app_builder_arguments_build_one_application(upstream_ckpt, monkeypatch):
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
    # the ingress is the cluster's (its environment): an argument that asks for the other one is refused, and
    # the router is Serve's proxy's only
    monkeypatch.delenv(HAPROXY_ENV, raising=False)
    with pytest.raises(ValueError, match="ingress=haproxy, but this Ray cluster runs Serve's proxy"):
        app_builder({"model": upstream_ckpt, "ingress": "haproxy"})
    def router(app) -> str:
        return app._bound_deployment._deployment_config.request_router_config.request_router_class

    assert router(app_builder({"model": upstream_ckpt, "ingress": "proxy"})) == \
        "chattts_velocity.server.routing.EngineLoadRouter"
    monkeypatch.setenv(HAPROXY_ENV, "1")
    with pytest.raises(ValueError, match="ingress=proxy, but this Ray cluster runs HAProxy"):
        app_builder({"model": upstream_ckpt, "ingress": "proxy"})
    assert "EngineLoadRouter" not in router(app_builder({"model": upstream_ckpt, "ingress": "haproxy"}))
    assert app_builder({"model": upstream_ckpt, "replicas": "2", "fronts": "3"}) is not None  # 3 per replica
    monkeypatch.delenv(HAPROXY_ENV)
    with pytest.raises(ValueError, match="3 fronts per replica need Serve's HAProxy ingress"):
        application(ScaleConfig(ingress="proxy"), ServerConfig(), load, fronts=3)


def test_the_kuberay_manifest_deploys_the_app_builder_with_the_settings_of_serve_replicas():
    """examples/kuberay/rayservice.yaml: Serve's own schema accepts its application config, whose import path is
    ``app_builder`` and whose args build the Serve application with the settings that ``chattts-velocity serve``
    makes of the same options; its cluster runs the Ray this project pins and has a GPU for every replica."""
    import importlib

    import yaml
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from chattts_velocity.cli import build_parser, serve_settings
    from chattts_velocity.server.scale import app_builder
    from chattts_velocity.server.settings import ServeSettings, parse_options

    manifest = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    [app] = config.applications
    assert (app.name, app.route_prefix) == (APP_NAME, "/")
    module, name = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), name)
    assert builder is app_builder
    assert isinstance(builder(app.args), serve.Application)
    settings = ServeSettings.from_options(parse_options(app.args), replicas=True)
    command = ["serve"] + [arg for key, value in app.args.items() for arg in ("--" + key.replace("_", "-"), str(value))]
    assert "--replicas" in command and serve_settings(build_parser().parse_args(command)) == settings
    assert config.http_options.keep_alive_timeout_s == settings.server.keep_alive_s

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray.__version__}-" in dockerfile
    pods = [cluster["headGroupSpec"]["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]
    for pod in pods:  # the API key reaches app_builder wherever Serve runs it
        [container] = pod["spec"]["containers"]
        assert "CHATTTS_VELOCITY_API_KEY" in {env["name"] for env in container["env"]}, container["name"]
    gpus = sum(group["replicas"] * group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
               for group in cluster["workerGroupSpecs"])
    assert gpus >= settings.scale.replicas * settings.scale.gpus_per_replica > 0


def test_the_board_forgets_replicas_that_stop_reporting_and_renders_each_labelled():
    from types import SimpleNamespace

    from chattts_velocity.server.cluster import ReplicaBoard
    from chattts_velocity.server.metrics import Metrics, labelled

    def stats(kv_used: int) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0, num_running=1, kv_blocks_used=kv_used, kv_blocks_total=64,
                               num_preemptions=0, num_generated_tokens=10)

    def metrics(replica: str) -> Metrics:
        return Metrics(SimpleNamespace(waiting=0, running=1), labels={"replica": replica})

    board = ReplicaBoard(stale_s=0.2)
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


def test_the_board_is_drained_once_every_replica_knows_and_has_no_request_left():
    from chattts_velocity.server.cluster import ReplicaBoard

    board = ReplicaBoard(stale_s=60)
    assert board.report("a", [], admitted=1) is False and board.report("b", [], admitted=0) is False
    assert not board.drained()  # nobody drains
    board.drain()
    assert board.report("a", [], admitted=1, draining=False) is True  # the answer tells a replica to drain
    assert not board.drained()
    board.report("b", [], admitted=0, draining=False)
    assert not board.drained(), "b had not yet heard of the drain when it counted: a request may have come since"
    board.report("b", [], admitted=0, draining=True)
    board.report("a", [], admitted=1, draining=True)
    assert not board.drained(), "a still has a request"
    board.report("a", [], admitted=0, draining=True)
    assert board.drained()
    board.report("c", [], admitted=0, draining=False)  # a replica that started meanwhile
    assert not board.drained()


# ------------------------------------------------------------------ through Serve's proxy


def test_the_router_ranks_replicas_with_kv_room_first_then_by_requests_in_flight():
    from chattts_velocity.engine import EngineStats
    from chattts_velocity.server.routing import KV_FULL, rank_by_load, routing_stats

    stats = EngineStats(num_waiting=1, num_running=3, kv_blocks_used=45, kv_blocks_total=50, num_preemptions=0,
                        num_steps=0, num_prompt_tokens=0, num_generated_tokens=0, max_batch_size=0, num_failed=0)
    assert routing_stats(stats, admitted=5) == {"sequences": 4, "kv_used": 0.9, "admitted": 5}
    reports = {"full": {"kv_used": KV_FULL, "sequences": 0, "admitted": 0}, "busy": {"kv_used": 0.1, "sequences": 9},
               "idle": {"kv_used": 0.0, "sequences": 0}, "fresh": {}, "unknown": {"admitted": 2, "sequences": 1}}
    in_flight = {"full": 0, "busy": 3, "idle": 1, "fresh": 0, "unknown": None}
    ranked = rank_by_load(list(reports), in_flight.get, reports.get, shuffle=lambda: 0.0)
    # KV room first; then requests in flight (the reported admitted count where the router knows none); then the
    # engine's sequences; a full KV cache last whatever its count
    assert ranked == ["fresh", "idle", "unknown", "busy", "full"]
    draws = iter([0.9, 0.1] * 50)
    assert rank_by_load(["a", "b"], lambda _: 2, lambda _: {}, shuffle=lambda: next(draws)) == ["b", "a"]


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
    before = own_metrics(server.url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda seed: post(server.url, body(seed=seed)), range(6)))
    assert [r.status_code for r in responses] == [200] * 6
    served = [r.headers[REPLICA_HEADER] for r in responses]
    assert set(served) == set(before), served
    after = own_metrics(server.url, before)  # each body was whole: its replica has counted it
    for replica in before:
        assert ok_count(after[replica]) - ok_count(before[replica]) == served.count(replica)
        assert after[replica]["chattts_kv_blocks_total"] > 0


def test_a_burst_fills_both_replicas_evenly_before_either_refuses(server):
    """Each replica admits MAX_CONCURRENT + MAX_QUEUE speech requests: a burst of twice that, all at once, is
    admitted whole only if every replica gets its share (HAProxy: the fewest connections; Serve's proxy:
    ``EngineLoadRouter``)."""
    assert_a_burst_fills_both_replicas_evenly(server)


def assert_a_burst_fills_both_replicas_evenly(server) -> None:
    share = MAX_CONCURRENT + MAX_QUEUE
    statuses: list[tuple[int, str]] = []
    lock = threading.Lock()
    opened = threading.Barrier(2 * share + 1, timeout=120)

    def hold(seed: int, stack: contextlib.ExitStack) -> None:
        try:
            r = stack.enter_context(httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(HELD, seed),
                                                 timeout=60))
            with lock:
                statuses.append((r.status_code, r.headers.get(REPLICA_HEADER)))
        finally:
            opened.wait()

    with contextlib.ExitStack() as stack:
        threads = [threading.Thread(target=hold, args=(seed, stack)) for seed in range(2 * share)]
        for t in threads:
            t.start()
        opened.wait()
        counts = defaultdict(int)
        for status, replica in statuses:
            counts[(status, replica)] += 1
        assert sorted(counts.values()) == [share, share] and all(s == 200 for s, _ in counts), dict(counts)
    for t in threads:
        t.join(30)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def replica_children() -> tuple[dict[int, int], dict[int, int]]:
    """({engine process pid: its Serve replica's pid}, {other front's pid: its replica's pid}) on this machine:
    a replica's other fronts listen (on Serve's socket), its engine process does not."""
    everything = processes()
    replicas = {pid for pid, (_, cmd) in everything.items() if cmd.startswith("ray::ServeReplica") and "SpeechServer" in cmd}
    children = spawned(replicas, everything)
    fronts = set(listening_pids(list(children), None))
    return ({pid: r for pid, r in children.items() if pid not in fronts},
            {pid: r for pid, r in children.items() if pid in fronts})


def replica_engines() -> dict[int, int]:
    """{engine process pid: its Serve replica's pid} on this machine."""
    return replica_children()[0]


def test_each_replicas_fronts_take_over_serves_socket_and_serve_within_its_limits(server):
    """``--fronts 2``: under each replica an engine process and two front processes, which hold the very
    listening socket of the replica's own HTTP server (Serve binds it without ``SO_REUSEPORT``) while the replica's
    process no longer does; both fronts answer requests, and the replica's ``/metrics`` counts what each served."""
    engines, fronts = replica_children()
    assert len(engines) == 2 and sorted(fronts.values()) == sorted(list(engines.values()) * 2), (engines, fronts)
    ports = listening_ports()
    replica_ports = {}
    for replica in engines.values():
        mine = [front for front, of in fronts.items() if of == replica]
        (shared,) = set.intersection(*(socket_inodes(front) for front in mine)) & set(ports)
        assert shared not in socket_inodes(replica), (replica, mine)
        replica_ports[replica] = ports[shared]
    before = own_metrics(server.url)
    served: list[tuple[str, str]] = []
    # HAProxy keeps its connections to a replica open and reuses them: connections of our own to each replica's
    # port show that both fronts accept (the kernel wakes those waiting; a busy one takes fewer)
    for port in replica_ports.values():
        fronts_seen = set()
        url = f"http://127.0.0.1:{port}{SPEECH}"
        for _ in range(10):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                responses = list(pool.map(lambda seed, url=url: httpx.post(url, headers=AUTH, json=body(seed=seed),
                                                                           timeout=120), range(4)))
            assert [r.status_code for r in responses] == [200] * 4
            served += [(r.headers[REPLICA_HEADER], r.headers[FRONT_HEADER]) for r in responses]
            fronts_seen |= {r.headers[FRONT_HEADER] for r in responses}
            if fronts_seen == {"1", "2"}:
                break
    assert set(served) == {(replica, front) for replica in before for front in "12"}, served
    after = own_metrics(server.url, before)
    for replica in before:
        assert ok_count(after[replica]) - ok_count(before[replica]) == [r for r, _ in served].count(replica)


def test_the_realtime_socket_works_through_serves_proxy(server):
    """``/v1/audio/speech/stream`` through Serve's proxy: text appended word by word speaks the HTTP route's
    samples, and a context cancelled mid-sentence ends with ``context.cancelled`` while the socket goes on."""
    text = "Hello there. This is a test of the speech server."
    want = http_pcm(server, text, seed=7)

    async def run() -> tuple[Heard, Heard, Heard]:
        async with await open_session(server) as ws:
            await send(ws, "session.update", session={"voice": "echo", "seed": 7})
            assert (await next_event(ws))["type"] == "session.updated"
            spoken = await speak(ws, "a", [w + " " for w in text.split()])
            await send(ws, "input_text.append", context_id="b", text=HELD)
            heard = {"b": Heard()}
            await hear(ws, heard, until=lambda h: h["b"].chunks)
            await send(ws, "context.cancel", context_id="b")
            await hear(ws, heard)
            again = await speak(ws, "c", [text])
            return spoken, heard["b"], again

    spoken, cancelled, again = asyncio.run(run())
    assert not spoken.errors and not again.errors, (spoken.errors, again.errors)
    assert_same_samples(spoken.pcm, want)
    assert_same_samples(again.pcm, want)
    assert cancelled.cancelled and cancelled.done is None and not cancelled.audio_after_end


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
    before = own_metrics(server.url)
    with httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(HELD), timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers[REPLICA_HEADER]
        chunks = r.iter_raw()  # held: a dropped iterator closes the connection
        next(chunks)
        first_audio = before[replica]["chattts_time_to_first_audio_seconds_count"] + 1

        def generating() -> bool:
            # any replica's view of this one will do, once it is from after this request's first audio
            m = per_replica(server.url)[replica]
            return m["chattts_time_to_first_audio_seconds_count"] >= first_audio and m["chattts_kv_blocks_used"] > 0

        wait_for(generating, 60, "the serving replica's blocks in use", period=0.1)
    # the connection is closed: the proxy cancels the replica's request, which aborts its engine requests

    def freed():
        # a view from after this request's first audio with no request running is from after its end
        m = per_replica(server.url)[replica]
        done = m["chattts_time_to_first_audio_seconds_count"] >= first_audio and m["chattts_running_requests"] == 0
        return done and m["chattts_kv_blocks_used"] == 0 and m

    after = wait_for(freed, 60, "the blocks freed", period=0.1)
    assert after["chattts_time_to_first_audio_seconds_count"] == first_audio
    assert after["chattts_real_time_factor_count"] == before[replica]["chattts_real_time_factor_count"], \
        "the request ran to its end instead of being aborted"


def assert_openai_error(response: httpx.Response, status: int, type_: str) -> None:
    """``response`` is ``status`` with OpenAI's error body of ``type_`` (the single server's), and ``Retry-After``."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_ and error["message"], error
    assert int(response.headers["retry-after"]) >= 1


def test_a_full_replica_answers_429_with_openais_error_body_and_retry_after(server):
    """Each replica admits MAX_CONCURRENT running and MAX_QUEUE queued speech requests. Streams (``HELD``: admitted
    until closed) are opened one after the other until each replica has refused one: each refuses when it holds
    exactly its own limits (never early: Serve's proxy may route unevenly, a replica's limits are its own), as the
    single server refuses; then a burst is refused by both; once the streams close, the server serves again."""
    per_replica_limit = MAX_CONCURRENT + MAX_QUEUE
    admitted: dict[str, int] = defaultdict(int)
    refusals: dict[str, httpx.Response] = {}
    with httpx.Client(headers=AUTH, timeout=60) as http, contextlib.ExitStack() as held:
        for seed in range(8 * per_replica_limit):  # bounded: each stream lands on either replica
            r = held.enter_context(http.stream("POST", server.url + SPEECH, json=body(HELD, seed)))
            replica = r.headers[REPLICA_HEADER]
            if r.status_code == 200:
                admitted[replica] += 1
                continue
            r.read()
            r.close()
            refusals[replica] = r
            if len(refusals) == 2:
                break
        assert len(refusals) == 2, (dict(admitted), {k: v.status_code for k, v in refusals.items()})
        for replica, refused in refusals.items():
            assert_openai_error(refused, 429, "rate_limit_error")
            assert admitted[replica] == per_replica_limit, (replica, dict(admitted))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            burst = list(pool.map(lambda seed: post(server.url, body(seed=seed)), range(6)))
        for r in burst:
            assert_openai_error(r, 429, "rate_limit_error")
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
    # an engine process under each replica (its fronts told apart once they listen: run alone, this test can
    # come before they took over Serve's socket)
    def one_under_each() -> dict[int, int] | None:
        engines = replica_engines()
        return engines if len(engines) == 2 and len(set(engines.values())) == 2 else None

    engines = wait_for(one_under_each, 60, "an engine process under each replica")
    alive_before = set(engines)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#SpeechServer#{victim}", namespace="serve"), no_restart=True)
    # the other replica keeps serving meanwhile. A request that HAProxy sends in the instant of the kill can get
    # HAProxy's own 500 or a connection closed without an answer (the dying replica's closing socket); a
    # client's retry, as the openai SDK's, reaches the survivor
    survivor_answer = None
    for _ in range(3):
        try:
            survivor_answer = post(server.url, body(seed=11))
        except httpx.RemoteProtocolError:
            time.sleep(0.5)
            continue
        if survivor_answer.status_code != 500 or REPLICA_HEADER in survivor_answer.headers:
            break
        time.sleep(0.5)
    for t in threads:
        t.join(90)
    assert survivor_answer is not None, "every try's connection closed without an answer"
    assert survivor_answer.status_code == 200, (survivor_answer.headers, survivor_answer.text)
    assert survivor_answer.headers[REPLICA_HEADER] != victim
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
    # the killed replica's engine process exits (its pipes closed), freeing its GPU; the new replica has its own
    orphaned = [engine for engine, replica in engines.items() if not running(replica)]
    assert len(orphaned) == 1, engines
    wait_for(lambda: not running(orphaned[0]), 60, "the killed replica's engine process to exit")
    now = wait_for(lambda: len(replica_engines()) == 2 and replica_engines(), 60, "an engine process per replica")
    assert len(set(now) & alive_before) == 1, (now, engines)
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


def test_sigterm_drains_with_503_while_the_streams_in_flight_finish_and_exits_0(server):
    whole = len(post(server.url, body(LONG, 5)).content)
    with httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(LONG, 5), timeout=60) as r, \
            httpx.stream("POST", server.url + SPEECH, headers=AUTH, json=body(HELD), timeout=60) as held:
        chunks = r.iter_raw()
        size = len(next(chunks))
        assert held.status_code == 200  # while it streams, the replicas are not done draining: the route stays
        server.terminate()
        # new requests are refused while the replicas drain, as a lone server refuses them
        refused = wait_for(lambda: (answer := post(server.url, body())).status_code != 200 and answer, 30,
                           "new requests refused", period=0.1)
        assert_openai_error(refused, 503, "server_error")
        health = wait_for(lambda: (answer := httpx.get(server.url + "/health", timeout=30)).status_code != 200
                          and answer, 30, "/health failing", period=0.1)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        size += sum(len(c) for c in chunks)
    assert r.status_code == 200 and size == whole
    assert server.proc.wait(90) == 0

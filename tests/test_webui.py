"""The Gradio web demo end to end: one app over a tiny checkpoint on 127.0.0.1, driven with ``gradio_client`` as
visitors (one ``Client`` per visitor session). Generation, streaming (one gapless AAC stream), two visitors at
once where one presses Stop, the queue limit, voice cloning, bad input; the engine's KV pool is checked free
after every test. The module runs as on a machine without ffmpeg: the page brings its own."""

from __future__ import annotations

import io
import os
import shutil
import time

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from gradio_client import Client, handle_file
from gradio_client.utils import QueueError
from webui_helpers import bundled_ffmpeg, path_without_ffmpeg, require_ffmpeg

from chattts_velocity import Chat
from chattts_velocity.engine import FinishReason
from chattts_velocity.server import ServerConfig
from chattts_velocity.webui import DemoConfig, build_demo
from chattts_velocity.webui.session import Session

MAX_NEW_TOKEN = 48
CONFIG = DemoConfig(max_new_token=MAX_NEW_TOKEN, max_refine_token=16, concurrency_limit=2, max_queue=2)
SHORT = "Hello world. How are you today? The weather is nice. Let us go for a walk in the park."
LONG = " ".join(["The story goes on and on, and nobody knows where it ends."] * 60)


@pytest.fixture(scope="module")
def chat(upstream_ckpt):
    c = Chat()
    c.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    yield c
    c.unload()


@pytest.fixture(scope="module")
def no_system_ffmpeg():
    """PATH without the system's ffmpeg while the module runs (where imageio-ffmpeg has a binary for this
    platform: else PATH stays as it is); imageio-ffmpeg's binary, or None."""
    saved, bundled = os.environ["PATH"], bundled_ffmpeg()
    if bundled is not None:
        os.environ["PATH"] = path_without_ffmpeg(saved)
    yield bundled
    os.environ["PATH"] = saved


@pytest.fixture(scope="module")
def url(chat, no_system_ffmpeg):
    demo = build_demo(chat, CONFIG)
    _, local_url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                                  ssr_mode=False)
    yield local_url
    demo.close()


@pytest.fixture(autouse=True)
def kv_pool_free_after(request):
    """Every test leaves the engine idle with its whole KV pool free (nothing held by a stopped visitor)."""
    yield
    if "url" in request.fixturenames:
        chat = request.getfixturevalue("chat")
        assert chat.engine.wait_idle(timeout=30)
        bm = chat.engine.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert chat.engine.stats().engine.kv_blocks_used == 0


def visitor(url: str) -> Client:
    return Client(url, verbose=False, download_files=False)


@pytest.fixture(scope="module")
def speaker(url) -> str:
    """The speaker string of timbre seed 7, from the page."""
    return visitor(url).predict(7, api_name="/speaker")


def generate_args(speaker: str, text: str, stream: bool, *, refine: bool = False, seed: int = 3,
                  sample_text: str = "", sample_code: str = "") -> list:
    """The /generate endpoint's inputs (the page's controls), in order."""
    return [text, refine, 0.3, 0.7, 20, speaker, seed, 4, sample_text, sample_code, stream]


def wav_of(result) -> np.ndarray:
    data, rate = sf.read(io.BytesIO(httpx.get(result[2]["url"]).content), dtype="int16")
    assert rate == 24000
    return data


def assert_same_audio(a: np.ndarray, b: np.ndarray) -> None:
    """Same tokens decode to the same audio up to float rounding (a few int16 steps): the decode windows are
    batched with whatever other streams are live."""
    assert a.shape == b.shape
    assert np.abs(a.astype(np.int32) - b).max() <= 4


def stream_seconds(result) -> float:
    """Decode what the page's player gets: the HLS playlist's AAC segments, joined."""
    playlist_url = result[1]["url"]
    playlist = httpx.get(playlist_url).text
    assert "#EXT-X-ENDLIST" in playlist
    base = playlist_url.rsplit("/", 1)[0]
    blob = b"".join(httpx.get(f"{base}/{line}").content for line in playlist.splitlines()
                    if line and not line.startswith("#"))
    with av.open(io.BytesIO(blob)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.rate


def press_stop(url: str, client: Client) -> None:
    """Stop as the page sends it: a direct call (``queue=False``), which a full queue does not turn away."""
    r = httpx.post(f"{url}gradio_api/run/stop", json={"data": [None], "session_hash": client.session_hash}, timeout=30)
    r.raise_for_status()


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_generate_shows_refined_text_and_a_reproducible_wav(url, chat, speaker):
    client = visitor(url)
    args = generate_args(speaker, SHORT, stream=False, refine=True)
    first = client.predict(*args, api_name="/generate")
    second = client.predict(*args, api_name="/generate")
    sentences = chat.prepare_texts(SHORT, True, None, True, True)
    assert first[0] != SHORT and len(first[0].split("\n")) == len(sentences) > 1  # refined, one per line
    audio = wav_of(first)
    assert audio.size > 0.2 * 24000 and np.abs(audio).max() > 0
    assert_same_audio(audio, wav_of(second))  # same seeds, same audio


def test_the_page_brings_its_own_ffmpeg_where_the_system_has_none(url, no_system_ffmpeg):
    if no_system_ffmpeg is None:
        pytest.skip("imageio-ffmpeg has no ffmpeg binary for this platform")
    found = shutil.which("ffmpeg")  # what Gradio runs for the streamed audio
    assert found is not None and os.path.realpath(found) == os.path.realpath(no_system_ffmpeg)


def test_stream_mode_sends_int16_chunks_as_one_gapless_aac_stream(url, speaker):
    require_ffmpeg()
    client = visitor(url)
    whole = wav_of(client.predict(*generate_args(speaker, SHORT, stream=False), api_name="/generate"))
    job = client.submit(*generate_args(speaker, SHORT, stream=True), api_name="/generate")
    result = job.result(timeout=60)
    assert len(job.outputs()) >= 4  # the text, then several audio chunks
    # one encoder per stream: only its priming frame and last partial frame are added (< 0.09 s), where an
    # encoder per chunk added 30-70 ms at every chunk boundary
    assert 0 <= stream_seconds(result) - whole.size / 24000 < 0.09


def test_stop_cancels_only_that_visitors_request_and_frees_its_blocks(url, chat, speaker, monkeypatch):
    require_ffmpeg()
    other_args = generate_args(speaker, SHORT * 3, stream=False, seed=11)
    expected = wav_of(visitor(url).predict(*other_args, api_name="/generate"))
    # slow every engine step, so that the stopper's sentences are still generating when Stop lands (the CPU
    # engine finishes a 48-token sentence in a few ms, and a Stop between two sentences aborts nothing; with
    # 30 ms a step, a loaded 2-core CI machine once let every sentence in flight end before Stop landed)
    engine, step = chat.engine.engine, chat.engine.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.08), step())[1])
    stopper, other = visitor(url), visitor(url)
    before = set(chat.engine.stats().requests)
    stopped = stopper.submit(*generate_args(speaker, LONG, stream=True), api_name="/generate")
    full = other.submit(*other_args, api_name="/generate")
    wait_for(lambda: len(stopped.outputs()) >= 2 or stopped.done())  # the stopper is hearing its audio
    assert not stopped.done(), stopped.exception()
    press_stop(url, stopper)
    stopped_result = stopped.result(timeout=30)
    assert_same_audio(wav_of(full.result(timeout=60)), expected)  # untouched by the Stop
    assert stream_seconds(stopped_result) > 0  # what was heard before the Stop stays playable
    assert chat.engine.wait_idle(timeout=30)  # the aborts are applied
    stats = chat.engine.stats()
    new = {rid: times.finish_reason for rid, times in stats.requests.items() if rid not in before}
    sentences = len(chat.prepare_texts(SHORT * 3, True, None, True, True)) + len(
        chat.prepare_texts(LONG, True, None, True, True))
    assert FinishReason.ABORT in new.values()
    assert len(new) < sentences  # the stopped visitor's later sentences were never submitted
    assert stats.engine.max_batch_size > CONFIG.in_flight  # the two visitors' sentences shared engine batches


def test_a_full_queue_tells_the_visitor_and_stop_still_gets_through(url, speaker):
    running_clients = [visitor(url) for _ in range(2)]
    running = [c.submit(*generate_args(speaker, LONG, stream=False), api_name="/generate") for c in running_clients]
    wait_for(lambda: all(j.status().code.name in ("PROCESSING", "ITERATING") for j in running))
    queued = []
    for _ in range(CONFIG.max_queue):  # the generation slots (2) are taken: these wait, and fill the queue
        queued.append(visitor(url).submit(*generate_args(speaker, SHORT, stream=False), api_name="/generate"))
        wait_for(lambda: queued[-1].status().code.name == "IN_QUEUE")
    with pytest.raises(QueueError, match="Queue is full"):
        visitor(url).predict(*generate_args(speaker, SHORT, stream=False), api_name="/generate")
    for client in running_clients:
        press_stop(url, client)
    for job in running:
        job.result(timeout=30)
    for job in queued:  # the waiting visitors are served once slots free
        assert wav_of(job.result(timeout=60)).size > 0


def test_voice_cloning_from_an_uploaded_sample(url, tmp_path, chat, speaker):
    from chattts_velocity.text import decode_prompt

    client = visitor(url)
    rate = 16000  # resampled to 24 kHz by the page
    t = np.arange(rate * 2) / rate
    sf.write(tmp_path / "sample.wav", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate)
    code = client.predict(handle_file(str(tmp_path / "sample.wav")), api_name="/sample_audio")
    assert decode_prompt(code, num_vq=chat.model.config.num_vq).shape[0] == chat.model.config.num_vq
    plain = client.predict(*generate_args(speaker, SHORT, stream=False), api_name="/generate")
    cloned = client.predict(*generate_args(speaker, SHORT, stream=False, sample_text="a low hum", sample_code=code),
                            api_name="/generate")
    a, b = wav_of(plain), wav_of(cloned)
    assert b.size > 0 and (a.size != b.size or not np.array_equal(a, b))


def test_a_too_short_voice_sample_is_refused_with_the_reason(url, tmp_path):
    sf.write(tmp_path / "short.wav", np.zeros(2400, dtype=np.float32), 24000)
    with pytest.raises(Exception, match="between 0.5 and 60 s"):
        visitor(url).predict(handle_file(str(tmp_path / "short.wav")), api_name="/sample_audio")


def test_bad_input_is_shown_to_the_visitor(url, speaker):
    client = visitor(url)
    with pytest.raises(Exception, match="text is empty"):
        client.predict(*generate_args(speaker, "   ", stream=False), api_name="/generate")
    with pytest.raises(Exception, match="speaker"):
        client.predict(*generate_args("not a speaker", SHORT, stream=False), api_name="/generate")


def test_a_text_past_the_servers_limit_is_refused_before_anything_runs(url, chat, speaker):
    limit = ServerConfig.max_input_chars
    text = ("Hello world, how are you today? " * (limit // 16))[: limit + 1]
    submitted = chat.engine.stats().num_requests
    with pytest.raises(Exception, match=f"{limit + 1:,} characters, at most {limit:,}"):
        visitor(url).predict(*generate_args(speaker, text, stream=False), api_name="/generate")
    assert chat.engine.stats().num_requests == submitted  # no sentence reached the engine


def test_the_input_box_stops_at_the_servers_limit(chat):
    assert CONFIG.max_input_chars == DemoConfig().max_input_chars == ServerConfig().max_input_chars
    demo = build_demo(chat, DemoConfig(max_input_chars=100))
    boxes = [b for b in demo.blocks.values() if getattr(b, "label", None) == "Input text"]
    assert len(boxes) == 1 and boxes[0].max_length == 100
    with pytest.raises(ValueError, match="max_input_chars"):
        DemoConfig(max_input_chars=0)


def test_timbre_seed_gives_upstreams_voice_for_that_seed(url, chat):
    client = visitor(url)
    torch.manual_seed(1111)
    assert client.predict(1111, api_name="/speaker") == chat.sample_random_speaker()


def test_stop_while_queued_cancels_the_run_before_it_starts():
    session = Session()
    session.arm()
    session.stop()
    run = session.start()
    assert run.cancelled
    held = []
    assert not run.hold(lambda: held.append("cancelled"))
    assert held == ["cancelled"]


def test_a_new_generation_of_the_same_visitor_supersedes_the_running_one():
    session = Session()
    first = session.start()
    cancelled = []
    assert first.hold(lambda: cancelled.append("first"))
    second = session.start()
    assert cancelled == ["first"] and not second.cancelled
    session.stop()
    assert second.cancelled


@pytest.mark.parametrize("kwargs", [{"max_new_token": 0}, {"concurrency_limit": 0}, {"max_queue": -1},
                                    {"in_flight": 1.5}, {"max_sample_seconds": 0.1}])
def test_demo_config_rejects_out_of_range_limits(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DemoConfig(**kwargs)


def test_queue_limits_are_sized_to_the_engine():
    assert DemoConfig().limits(64) == (16, 64)
    assert DemoConfig(in_flight=4).limits(2) == (1, 4)
    assert DemoConfig(concurrency_limit=3, max_queue=5).limits(64) == (3, 5)

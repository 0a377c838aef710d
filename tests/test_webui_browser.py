"""The web demo as a person sees it: ``chattts-velocity webui`` started from the command line over a tiny
checkpoint, opened in headless Chromium (Debian's ``chromium``, driven by Playwright; no browser download),
Generate clicked, the audio player checked to hold audio, and a screenshot kept as a test artifact. The web demo's
process runs without the system's ffmpeg on its PATH: it brings its own for the streamed audio."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from webui_helpers import bundled_ffmpeg, path_without_ffmpeg

CHROMIUM = "/usr/bin/chromium"
# the machine has no network: without these Chromium stalls on its background connections
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install -y chromium; .ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def page_url(upstream_ckpt, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("webui") / "webui.log"
    cmd = [sys.executable, "-m", "chattts_velocity.cli", "webui", "--model", upstream_ckpt, "--device", "cpu",
           "--port", str(port), "--max-new-token", "48"]
    path = os.environ["PATH"]
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False",
           "PATH": path_without_ffmpeg(path) if bundled_ffmpeg() is not None else path}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):
            assert proc.poll() is None, f"webui exited with {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"webui did not start: {log.read_text()}"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


AUDIO = """() => {
    const found = [];
    const walk = (root) => root.querySelectorAll("*").forEach((el) => {
        if (el.tagName === "AUDIO" && el.currentSrc) found.push(el);
        if (el.shadowRoot) walk(el.shadowRoot);  // the players live in shadow roots
    });
    walk(document);
    return found.map((a) => ({duration: isFinite(a.duration) ? a.duration : 0, time: a.currentTime}));
}"""
LONG = " ".join(["The story goes on and on, and nobody knows where it ends."] * 40)


def _players(page) -> list[dict]:
    return page.evaluate(AUDIO)


def test_generate_then_stream_and_stop_in_the_browser(page_url):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(page_url, wait_until="domcontentloaded", timeout=60_000)
            generate = page.get_by_role("button", name="Generate")
            text = page.get_by_label("Input text")
            example = text.input_value()
            text.fill("   ")
            generate.click(timeout=60_000)
            page.get_by_text("text is empty").first.wait_for(timeout=30_000)  # the reason, in a toast
            page.get_by_role("button", name="Stop").wait_for(state="hidden", timeout=30_000)
            text.fill(example)
            generate.click()  # the first example, refined, as one wav
            page.wait_for_function(f"() => ({AUDIO})().some((a) => a.duration > 0.2)", timeout=60_000)
            refined = page.locator("label", has_text="Output text").locator("textarea")  # read-only: no role
            assert refined.input_value().strip()  # the refined text is shown
            page.screenshot(path=str(ARTIFACTS / "webui.png"), full_page=True)

            page.get_by_label("Refine text").uncheck()
            page.get_by_label("Stream mode").check()
            text.fill(LONG)
            generate.click()
            stop = page.get_by_role("button", name="Stop")
            stop.wait_for(state="visible", timeout=10_000)
            # the streamed audio starts playing by itself while the rest is still being generated
            page.wait_for_function(f"() => ({AUDIO})().some((a) => a.time > 0.1)", timeout=60_000)
            stop.click()
            stop.wait_for(state="hidden", timeout=30_000)
            assert generate.is_enabled()
            page.screenshot(path=str(ARTIFACTS / "webui_stream_stopped.png"), full_page=True)
            played = max(a["time"] for a in _players(page))
        finally:
            browser.close()
    print(f"screenshots: {ARTIFACTS / 'webui.png'}, {ARTIFACTS / 'webui_stream_stopped.png'}")
    assert played > 0.1

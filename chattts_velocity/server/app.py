"""The OpenAI-compatible speech server: one FastAPI app over one ``EngineClient`` (the engine in this process,
in an engine process, or in a Ray Serve replica: chosen at launch, ``run.py``; the routes never ask which).

A speech request is validated, admitted against ``max_concurrent`` running and ``max_queue`` waiting requests
(429 with ``Retry-After`` beyond), prepared on the event loop by the client's ``kit`` (sentences, voice,
prompts, the engine's own validation; a refine pass awaits the engine), started in its handler when a running
slot is free (else when its body gets one), and streamed as it is encoded (``streaming``). A client that goes
away has its request cancelled, which ends its engine requests. Bad input is a 4xx with OpenAI's error body,
never a traceback (``errors``)."""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from ..serving.client import EngineClient, EngineGoneError
from ..serving.voices import UnknownVoiceError, read_sample
from ..timeline import traced
from .admission import Admission, QueueFullError
from .errors import ApiKeyAuth, BodyLimit, install_error_handlers
from .metrics import Metrics
from .prepare import code_params, refine_params
from .realtime.context import SpeechContext
from .realtime.route import install_realtime
from .schema import OPENAI_MODELS, SpeechRequest, error
from .settings import ServerConfig
from .streaming import Streams
from .timeouts import within

STATS_WAIT_S = 5.0
"""How long ``/metrics`` waits for the engine's stats."""
ENDPOINTS = ["/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/health", "/metrics"]


class SpeechState:
    """What the routes share (``app.state.speech``): the client, the admission, the metrics, the bodies in
    flight, and whether the server is draining (a graceful shutdown: new speech requests get 503)."""

    def __init__(self, client: EngineClient, config: ServerConfig, admission: Admission,
                 metric_labels: dict[str, str] | None = None):
        self.client, self.config, self.admission = client, config, admission
        self.metrics = Metrics(admission, metric_labels)
        self.streams = Streams(self.metrics, config.send_timeout_s)
        self.draining = False

    @property
    def in_flight(self) -> int:
        """Speech bodies streaming now (what a graceful shutdown waits for)."""
        return self.streams.in_flight


def build_app(client: EngineClient, config: ServerConfig | None = None, admission: Admission | None = None,
              metric_labels: dict[str, str] | None = None) -> FastAPI:
    """The app over ``client``. ``admission``: the requests' limits (default: ``config``'s, for this process
    alone; several fronts of one engine share counts); ``metric_labels``: put on every series of ``/metrics``
    (a Ray Serve replica's own)."""
    config = config or ServerConfig()
    admission = admission or Admission(config.max_concurrent, config.max_queue)
    state = SpeechState(client, config, admission, metric_labels)
    client.share_metrics(state.metrics.own)
    app = FastAPI(title="chattts-velocity", version="0.1.0")
    app.state.speech = state
    install_error_handlers(app, state.metrics)
    app.add_middleware(BodyLimit, max_body=config.max_body_bytes, max_upload=config.max_upload_bytes,
                       metrics=state.metrics, timeout_s=config.body_timeout_s)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, key=config.api_key, metrics=state.metrics)

    @app.get("/")
    async def root() -> dict:
        return {"name": "chattts-velocity", "endpoints": ENDPOINTS}

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        gone = client.health()
        if gone is not None:
            return JSONResponse({"status": f"unavailable: {gone}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:  # a hung engine must not hang the scrape: the scrape fails (503), as /health says why
            stats = await within(client.stats(), STATS_WAIT_S)
        except TimeoutError:
            raise EngineGoneError(f"the engine did not report its stats within {STATS_WAIT_S:g} s") from None
        body, content_type = state.metrics.render(stats, await client.peer_metrics())
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        names = (config.model_name, *OPENAI_MODELS)
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "chattts-velocity"} for n in names]}

    @app.get("/v1/audio/voices")
    async def voices() -> dict:
        await anyio.to_thread.run_sync(client.voices.reload)
        return {"voices": [{"id": v.id, "name": v.name} for v in client.voices.list()]}

    @app.post("/v1/audio/voices", status_code=201)
    async def register_voice(audio: Annotated[UploadFile, File()], transcript: Annotated[str, Form()],
                             name: Annotated[str, Form()] = "") -> Response:
        data = await audio.read()
        try:
            wav = await anyio.to_thread.run_sync(read_sample, data, config.max_upload_bytes)
            voice = await client.register_voice(name, wav, transcript)
        except ValueError as e:
            return error(400, str(e), param="audio" if "audio" in str(e) else "transcript")
        return JSONResponse({"id": voice.id, "name": voice.name}, status_code=201)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request) -> Response:
        return await _speech(state, body, request.url.path)

    install_realtime(app, state)
    return app


@traced("prepare a speech request")
async def _speech(state: SpeechState, body: SpeechRequest, path: str) -> Response:
    refusal = _refusal(state, body)
    if refusal is not None:
        state.metrics.count(path, refusal.status_code)
        return refusal
    try:
        ticket = state.admission.admit()
    except QueueFullError as e:
        state.metrics.count(path, 429)
        return error(429, str(e), "rate_limit_error", headers={"Retry-After": str(state.config.retry_after_s)})
    client, config, started = state.client, state.config, time.monotonic()
    try:
        # on the event loop, no thread hop: a hop to a worker thread under load waits for the GIL, and each busy
        # worker thread makes the engine thread wait for it after every torch call (docs/perf/)
        voice = client.voices.resolve(body.voice)
        texts = client.kit.prepare_texts(body.input)
        if body.refines:
            texts = await client.refine(texts, refine_params(body))
        code = code_params(body, voice, config)
        prompts, params = client.kit.prompts(texts, code)
        if body.stream_format == "sse":  # sentence by sentence, for the body's speech.segment events
            audio = SpeechContext(client, "sse", code, config.in_flight_sentences, config.max_input_chars)
            audio.speak(texts, prompts, params)
            audio.end()
        else:
            audio = client.start(prompts, params, config.in_flight_sentences)
    except (UnknownVoiceError, ValueError) as e:
        ticket.cancel()
        unknown = isinstance(e, UnknownVoiceError)
        state.metrics.count(path, 404 if unknown else 400)
        if unknown:
            return error(404, str(e), param="voice", code="voice_not_found")
        return error(400, str(e), param="input")
    except BaseException:
        ticket.cancel()
        raise
    state.metrics.prepare.observe(time.monotonic() - started)
    state.metrics.count(path, 200)
    wakeup = None
    if body.stream_format != "sse" and await ticket.take_if_free():
        # the engine starts now, not when the body does: in a burst the event loop sends everybody's headers
        # first. The body reads through the loop's wake-ups.
        wakeup = state.streams.wakeup()
        audio.on_ready(wakeup.set)
        audio.start()
    return state.streams.response(body, audio, ticket, wakeup)


def _refusal(state: SpeechState, body: SpeechRequest) -> Response | None:
    """Why a speech request is refused before admission (draining, no input, too long), else None."""
    if state.draining:
        return error(503, "the server is shutting down", "server_error", headers={"Retry-After": "5"})
    if not body.input.strip():
        return error(400, "input is empty", param="input")
    limit = state.config.max_input_chars
    if len(body.input) > limit:
        return error(400, f"input has {len(body.input)} characters, at most {limit} are allowed", param="input",
                     code="string_above_max_length")
    return None

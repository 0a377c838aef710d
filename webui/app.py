"""The Gradio page: ChatTTS's own web UI (text, refine, sampling sliders, timbre presets and seeds, speaker
string, voice cloning from a sample, streaming, Generate / Stop, examples) over one loaded ``Chat``.

Every visitor has a ``Session`` in a ``gr.State``; all of them share the chat's engine, so the sentences of
every visitor generating at once meet in the same engine batches. Generations run at most ``concurrency``
at once (sized to the engine's ``max_num_seqs``) and at most ``max_queue`` wait; beyond that Gradio turns the
visitor away with its own message ("This application is currently busy", "Queue is full" to API clients).
Stop cancels the visitor's own run (``Session.stop``); it and the page's small controls skip the queue, so
they answer even when the queue is full."""

from __future__ import annotations

import random
from collections.abc import Iterator

import gradio as gr
import numpy as np

from chattts_velocity.chat import Chat
from chattts_velocity.constants import SAMPLE_RATE

from .config import DemoConfig
from .examples import EXAMPLES
from .ffmpeg import ensure_ffmpeg
from .generate import Settings, prepare, refine, speak
from .session import Session
from .timbre import SEED_RANGE, TIMBRES, sample_code, speaker_for_seed

DICE = "\U0001f3b2"


def build_demo(chat: Chat, config: DemoConfig | None = None) -> gr.Blocks:
    """The page over a loaded ``Chat`` (its queue already configured; ``launch`` it). Puts an ``ffmpeg`` on PATH
    for the streamed audio where the system has none (``ensure_ffmpeg``)."""
    config = config or DemoConfig()
    ensure_ffmpeg()
    concurrency, max_queue = config.limits(chat.engine.config.max_num_seqs)
    with gr.Blocks(title="ChatTTS Velocity", analytics_enabled=False) as demo:
        session = gr.State(Session())
        gr.Markdown("# ChatTTS Velocity\nChatTTS text to speech on a continuous-batching engine: every visitor's "
                    "request is batched with the others'.")
        c = _layout(chat, config)
        _wire_voices(chat, config, c)
        inputs = [session, c.text, c.refine, c.temperature, c.top_p, c.top_k, c.speaker, c.audio_seed,
                  c.text_seed, c.sample_text, c.sample_code, c.stream]
        buttons = [c.generate, c.stop]
        generation = c.generate.click(_arm, session, buttons, queue=False, api_visibility="private").then(
            _generator(chat, config), inputs, [c.text_out, c.audio_stream, c.audio_full], api_name="generate",
            concurrency_limit=concurrency, concurrency_id="generate",
        )
        for after in (generation.then, generation.failure):  # Gradio 6 runs no `then` after a failure
            after(_idle, None, buttons, queue=False, api_visibility="private")
        c.stop.click(_stop, session, buttons, queue=False, api_name="stop")
        c.stream.change(_show_audio, c.stream, [c.audio_stream, c.audio_full], queue=False, api_visibility="private")
        gr.Examples(EXAMPLES, [c.text, c.temperature, c.top_p, c.top_k, c.audio_seed, c.text_seed, c.refine])
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    return demo


def launch(chat: Chat, config: DemoConfig | None = None, host: str = "127.0.0.1", port: int = 7860,
           share: bool = False) -> int:
    """Build the page and serve it until interrupted."""
    config = config or DemoConfig()
    concurrency, _ = config.limits(chat.engine.config.max_num_seqs)
    demo = build_demo(chat, config)
    # every running generation holds a worker thread while it waits for audio
    demo.launch(server_name=host, server_port=port, share=share, max_threads=max(40, concurrency + 8),
                ssr_mode=False)
    return 0


class _Controls:
    """The page's components, by name."""


def _layout(chat: Chat, config: DemoConfig) -> _Controls:
    c = _Controls()
    first = EXAMPLES[0]
    with gr.Row():
        with gr.Column(scale=2):
            c.text = gr.Textbox(label="Input text", lines=4, max_lines=8, value=first[0], placeholder="Text to speak",
                                max_length=config.max_input_chars,
                                info=f"At most {config.max_input_chars:,} characters")
            c.sample_text = gr.Textbox(label="Sample text", lines=2, max_lines=4,
                                       placeholder="Transcript of the voice sample: with a sample, it replaces "
                                                   "the speaker embedding")
        with gr.Column():
            with gr.Tab("Sample audio"):
                c.sample_audio = gr.Audio(sources=["upload"], type="numpy", show_label=False)
            with gr.Tab("Sample audio code"):
                c.sample_code = gr.Textbox(lines=6, max_lines=6, show_label=False,
                                           placeholder="Filled from the uploaded sample; may be pasted")
    with gr.Row():
        c.refine = gr.Checkbox(label="Refine text", value=first[6])
        c.temperature = gr.Slider(0.00001, 1.0, step=0.00001, value=first[1], label="Audio temperature")
        c.top_p = gr.Slider(0.1, 0.9, step=0.05, value=first[2], label="top_P")
        c.top_k = gr.Slider(1, 20, step=1, value=first[3], label="top_K")
    with gr.Row():
        c.timbre = gr.Dropdown(list(TIMBRES), value="Default", label="Timbre")
        c.timbre_seed = _seed("Timbre seed", TIMBRES["Default"])
        c.timbre_dice = gr.Button(DICE, scale=0, min_width=60)
        c.audio_seed = _seed("Audio seed", first[4])
        c.audio_dice = gr.Button(DICE, scale=0, min_width=60)
        c.text_seed = _seed("Text seed", first[5])
        c.text_dice = gr.Button(DICE, scale=0, min_width=60)
    c.speaker = gr.Textbox(label="Speaker embedding", value=speaker_for_seed(chat, TIMBRES["Default"]),
                           max_lines=3, buttons=["copy"], placeholder="Blank: the model's default voice")
    with gr.Row():
        c.stream = gr.Checkbox(label="Stream mode", value=False)
        c.generate = gr.Button("Generate", variant="primary", scale=2)
        c.stop = gr.Button("Stop", variant="stop", scale=2, visible=False)
    c.text_out = gr.Textbox(label="Output text", interactive=False, buttons=["copy"])
    # the streamed audio plays as it arrives (Gradio applies `autoplay` only when the page loads, so unlike
    # upstream's web UI there is no auto-play switch: the whole-wav player waits for the visitor's click)
    c.audio_stream = gr.Audio(label="Output audio", streaming=True, autoplay=True, interactive=False,
                              visible=False)
    c.audio_full = gr.Audio(label="Output audio", format="wav", autoplay=False, interactive=False)
    return c


def _seed(label: str, value: int) -> gr.Number:
    return gr.Number(value, label=label, precision=0, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])


def _wire_voices(chat: Chat, config: DemoConfig, c: _Controls) -> None:
    def dice() -> int:
        return random.randint(*SEED_RANGE)

    def speaker(seed: float | None) -> str:
        if seed is None:
            raise gr.Error("the timbre seed is empty: pick a preset or roll the dice")
        return speaker_for_seed(chat, int(seed))

    def sample(audio: tuple[int, np.ndarray] | None) -> str:
        if audio is None:
            return ""
        try:
            code = sample_code(chat, audio, config.max_sample_seconds)
        except ValueError as e:
            raise gr.Error(str(e)) from None
        gr.Info("The voice sample's code is in the 'Sample audio code' tab.")
        return code

    c.timbre.change(TIMBRES.get, c.timbre, c.timbre_seed, queue=False, api_visibility="private")
    for button, number in ((c.timbre_dice, c.timbre_seed), (c.audio_dice, c.audio_seed), (c.text_dice, c.text_seed)):
        button.click(dice, None, number, queue=False, api_visibility="private")
    c.timbre_seed.change(speaker, c.timbre_seed, c.speaker, queue=False, api_name="speaker")
    c.sample_audio.change(sample, c.sample_audio, c.sample_code, api_name="sample_audio")


def _generator(chat: Chat, config: DemoConfig):
    def generate(session: Session, text: str, refine_text: bool, temperature: float, top_p: float, top_k: float,
                 speaker: str, audio_seed: float, text_seed: float, sample_text: str, sample_code_: str,
                 stream: bool) -> Iterator[tuple]:
        """Refined text first, then the audio: int16 chunks into the streaming player, or the whole wav."""
        _check_length(text or "", config.max_input_chars)
        run = session.start()
        try:
            settings = Settings(text or "", bool(refine_text), float(temperature), float(top_p), int(top_k),
                                speaker or "", _int(audio_seed, "audio seed"), _int(text_seed, "text seed"),
                                sample_text or "", sample_code_ or "")
            if settings.half_sample:
                gr.Warning("Voice cloning needs both the sample audio code and its transcript (Sample text): "
                           "the speaker embedding is used instead.")
            texts = _checked(prepare, chat, settings.text)
            shown = settings.text
            if settings.refine:
                texts = _checked(refine, chat, texts, settings.refine_params(config.max_refine_token), run)
                if texts is None:
                    return
                shown = "\n".join(texts)
            yield shown, gr.skip(), None
            chunks = _checked(speak, chat, texts, settings.code_params(config.max_new_token), run, config.in_flight)
            parts = []
            for chunk in chunks:
                if stream:
                    yield shown, (SAMPLE_RATE, chunk), gr.skip()
                else:
                    parts.append(chunk)
            if parts:
                yield shown, gr.skip(), (SAMPLE_RATE, np.concatenate(parts))
        finally:
            run.cancel()  # Gradio closes this generator when the visitor leaves: free the engine at once

    return generate


def _checked(fn, *args):
    """``fn(*args)``, its ``ValueError`` (bad input) shown to the visitor."""
    try:
        return fn(*args)
    except ValueError as e:
        raise gr.Error(str(e)) from None


def _check_length(text: str, limit: int) -> None:
    """Refuse a text past the limit (the page's textbox stops there, an API call does not)."""
    if len(text) > limit:
        raise gr.Error(f"the text has {len(text):,} characters, at most {limit:,} are allowed: shorten it or "
                       "generate it in parts")


def _int(value: float | None, name: str) -> int:
    if value is None:
        raise gr.Error(f"the {name} is empty: enter a number or roll the dice")
    return int(value)


def _arm(session: Session) -> tuple:
    session.arm()
    return gr.update(interactive=False), gr.update(visible=True)


def _stop(session: Session) -> tuple:
    session.stop()
    return _idle()


def _idle() -> tuple:
    return gr.update(interactive=True), gr.update(visible=False)


def _show_audio(stream: bool) -> tuple:
    return gr.update(visible=stream), gr.update(visible=not stream)

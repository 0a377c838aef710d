"""``SpeechContext`` over a ``LocalClient``: text appended in any pieces gives the HTTP route's samples (its
sentences, its joins), segments that tile the audio in order, a cancel that ends the events and frees the
engine, and contexts that do not disturb each other."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from chattts_velocity.audio.joins import FADE
from chattts_velocity.params import InferCodeParams
from chattts_velocity.server.realtime.context import AudioOut, DoneOut, FailedOut, SegmentOut, SpeechContext
from chattts_velocity.serving.kit import SpeechKit
from chattts_velocity.serving.local import LocalClient
from chattts_velocity.text.split import split_text

TEXT = "The first sentence. A second one, with a pause. 第三句话。 And the end"
OTHER = "Another voice speaks. It says two things."


@pytest.fixture(scope="module")
def client(chat):
    return LocalClient(chat)


def params(client, seed: int = 1, tokens: int = 30, voice: str = "echo") -> InferCodeParams:
    spk = client.voices.resolve(voice).spk_emb
    return InferCodeParams(spk_emb=spk, manual_seed=seed, max_new_token=tokens, min_new_token=tokens,
                           show_tqdm=False)


def route_audio(client, text: str, p: InferCodeParams) -> np.ndarray:
    """What the HTTP route's audio is for ``text``: all its sentences in one joined request."""
    audio = client.start(*client.kit.prompts(client.kit.prepare_texts(text), p), 4)
    audio.start()
    return np.concatenate(list(audio))


def engine_is_idle(chat) -> bool:
    assert chat.engine.wait_idle(timeout=30)
    stats = chat.engine.stats().engine
    return stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


async def feed(context: SpeechContext, appends: list[str], end: bool = True) -> None:
    for text in appends:
        context.append(text)
        await asyncio.sleep(0)  # the reader runs between appends, as between a socket's messages
    if end:
        context.end()


async def collect(context: SpeechContext) -> list:
    return [event async for event in context.events()]


def speak(client, appends: list[str], p: InferCodeParams, in_flight: int = 2) -> list:
    async def run() -> list:
        context = SpeechContext(client, "c", p, in_flight, 4096)
        events, _ = await asyncio.gather(collect(context), feed(context, appends))
        return events

    return asyncio.run(run())


def samples(events: list) -> np.ndarray:
    return np.concatenate([e.samples for e in events if isinstance(e, AudioOut)])


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    # the same tokens; windows decoded in batches of another make-up differ in float rounding only
    assert got.size == want.size > 0
    assert np.allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cut", ["characters", "words", "sentences", "whole"])
def test_appends_of_any_size_give_the_routes_samples(client, chat, cut):
    p = params(client)
    appends = {"characters": list(TEXT), "words": [w + " " for w in TEXT.split(" ")][:-1] + [TEXT.split(" ")[-1]],
               "sentences": [s for s in split_text(TEXT)], "whole": [TEXT]}[cut]
    assert "".join(appends) == TEXT
    events = speak(client, appends, p)
    assert_same_audio(samples(events), route_audio(client, TEXT, p))
    assert isinstance(events[-1], DoneOut) and not any(isinstance(e, FailedOut) for e in events)
    assert events[-1] == DoneOut(len(TEXT), samples(events).size / 24000)
    assert engine_is_idle(chat)


def test_segments_tile_the_audio_in_order_each_after_its_audio(client):
    p = params(client)
    events = speak(client, [TEXT], p, in_flight=3)
    segments = [e for e in events if isinstance(e, SegmentOut)]
    assert [s.text for s in segments] == split_text(TEXT)
    assert segments[0].start_s == 0 and segments[-1].end_s == samples(events).size / 24000
    assert all(a.end_s == b.start_s for a, b in zip(segments[:-1], segments[1:], strict=True))
    assert all(s.end_s - s.start_s > 0.1 for s in segments)
    sent = 0.0
    for event in events[:-1]:
        if isinstance(event, AudioOut):
            sent += event.samples.size / 24000
        elif isinstance(event, SegmentOut):  # its audio is out before it, and none of the next
            assert abs(sent - event.end_s) < 1e-9
    assert abs(sent - events[-1].audio_seconds) < 1e-9


def test_a_flushed_context_holds_only_the_join_until_it_ends(client):
    p = params(client)

    async def run() -> tuple[list, list]:
        context = SpeechContext(client, "c", p, 2, 4096)
        reader = context.events()
        context.append("Spoken before the flush")
        context.flush()
        first = []
        while not any(isinstance(e, SegmentOut) for e in first):
            first.append(await anext(reader))
        await asyncio.sleep(0.2)  # nothing more comes while the context stays open
        context.append(" and after it. ")
        context.end()
        return first, [e async for e in reader]

    first, rest = asyncio.run(run())
    segment = first[-1]
    assert segment.text == "Spoken before the flush"
    assert abs(samples(first).size / 24000 + FADE / 24000 - segment.end_s) < 1e-9  # the join's fade waits
    texts = client.kit.prepare_texts("Spoken before the flush") + client.kit.prepare_texts(" and after it. ")
    want = np.concatenate(list(client.start(*client.kit.prompts(texts, p), 4)))
    assert_same_audio(np.concatenate([samples(first), samples(rest)]), want)
    assert [e.text for e in rest if isinstance(e, SegmentOut)] == [" and after it. "]


def test_unreadable_sentences_are_dropped_and_nothing_readable_is_invalid_input(client):
    p = params(client)
    text = "Readable here. 😀😀. And more."
    events = speak(client, list(text), p)
    assert_same_audio(samples(events), route_audio(client, text, p))
    assert [e.text for e in events if isinstance(e, SegmentOut)] == ["Readable here. ", "And more."]
    events = speak(client, ["😀. ", "🙂"], p)
    assert [type(e) for e in events] == [FailedOut, DoneOut]
    assert events[0].code == "invalid_input" and "nothing the model can read" in events[0].message
    assert events[1] == DoneOut(4, 0.0)


def test_a_sentence_the_engine_refuses_fails_the_context(chat):
    client = LocalClient(chat)
    p = params(client)
    room = client.kit.prompts(["Short."], p)[0][0].ids.shape[0] + 1  # a KV cache for the short one only
    kit = client.kit
    client.kit = SpeechKit(kit.tokenizer, kit.config, kit.speaker_stats, kv_capacity=room, normalizer=kit.normalizer)
    events = speak(client, ["Short. ", "A much longer sentence than the first one. "], p)
    assert isinstance(events[-1], FailedOut) and events[-1].code == "invalid_input"
    assert "leaves no room to generate" in events[-1].message
    assert engine_is_idle(chat)


def test_over_the_buffer_cap_is_refused_and_settings_are_checked_up_front(client):
    context = SpeechContext(client, "c", params(client), 1, 10)
    with pytest.raises(ValueError, match="11 characters appended at once"):
        context.append("Two words. ")
    context.append("Word")
    with pytest.raises(ValueError, match="11 characters would wait"):
        context.append("s and m")
    context.append(" one. Two")  # what waits is what follows the sentence's end
    context.append("1234567. ")
    context.append("x" * 10)
    context.end()
    with pytest.raises(ValueError, match="has ended"):
        context.append("more")
    bad = InferCodeParams(temperature=-1, show_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SpeechContext(client, "c", bad, 1, 10)


def test_cancel_ends_the_events_and_frees_the_engine(client, chat):
    p = params(client, tokens=300)
    long = " ".join(f"Sentence {i} of a context that is cancelled early." for i in range(6))

    async def run() -> list:
        context = SpeechContext(client, "c", p, 3, 4096)
        reader = context.events()
        context.append(long)
        first = await anext(reader)
        assert isinstance(first, AudioOut)
        assert chat.engine.stats().engine.num_running > 0
        context.cancel()
        return [e async for e in reader]

    before = chat.engine.stats().engine.num_generated_tokens
    assert asyncio.run(run()) == []
    assert engine_is_idle(chat)
    assert chat.engine.stats().engine.num_generated_tokens - before < 3 * 300


def test_two_contexts_interleaved_each_equal_their_solo_audio(client, chat):
    p, q = params(client, seed=1), params(client, seed=5, voice="nova")
    solo = samples(speak(client, [TEXT], p)), samples(speak(client, [OTHER], q))

    async def run() -> tuple[list, list]:
        a, b = SpeechContext(client, "a", p, 2, 4096), SpeechContext(client, "b", q, 2, 4096)

        async def both() -> None:
            for i in range(max(len(TEXT), len(OTHER))):
                for context, text in ((a, TEXT), (b, OTHER)):
                    if i < len(text):
                        context.append(text[i])
                await asyncio.sleep(0)
            a.end()
            b.end()

        got_a, got_b, _ = await asyncio.gather(collect(a), collect(b), both())
        return got_a, got_b

    got_a, got_b = asyncio.run(run())
    assert_same_audio(samples(got_a), solo[0])
    assert_same_audio(samples(got_b), solo[1])
    assert engine_is_idle(chat)

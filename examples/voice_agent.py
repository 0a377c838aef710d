"""A voice agent over the speech server's realtime WebSocket: an answer is spoken while the LLM is still writing
it, and the user can interrupt it. A fake LLM yields its answer word by word (about 15 words a second); each word
is appended to a context as it comes; the audio is played as it arrives (into a wav file, in real time: a sound
card would take it here) and each spoken sentence's place in it is printed. Some seconds into the first answer's
playback the user interrupts: the player drops what it has not played, that context is cancelled, and the second
answer is spoken in a new context on the same socket.

    chattts-velocity serve                    # in another shell (--model DIR for a local checkpoint)
    python examples/voice_agent.py
    python examples/voice_agent.py --url ws://127.0.0.1:8000 --api-key KEY --interrupt-after 2

Writes OUT/voice_agent.wav (24 kHz mono, 16-bit): what the user heard, both answers."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import wave

from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

ROUTE = "/v1/audio/speech/stream"
RATE = 24000
FIRST_ANSWER = ("Sure, here is the plan for tomorrow. The train leaves at seven and arrives just after nine. "
                "From the station it is a short walk to the office. Your first meeting starts at ten. "
                "After lunch there is a long review with the whole team. In the evening you are free.")
SECOND_ANSWER = "Of course, I will stop there. What would you like to know instead?"


async def fake_llm(answer: str, words_per_s: float):
    """An LLM writing its answer: one word (with its space) at a time."""
    for word in answer.split():
        await asyncio.sleep(1 / words_per_s)
        yield word + " "


class Player:
    """Plays 16-bit PCM in real time into ``wav``: audio is queued as it arrives and written as its time comes."""

    def __init__(self, wav: wave.Wave_write):
        self.wav, self.queue, self.played = wav, bytearray(), 0

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            due = min(len(self.queue), 2 * int((now - last) * RATE))
            self.wav.writeframes(self.queue[:due])
            del self.queue[:due]
            self.played, last = self.played + due // 2, now

    def stop(self) -> None:
        self.queue.clear()  # the user spoke: what is not played yet is never heard

    async def drain(self) -> None:
        while self.queue:
            await asyncio.sleep(0.02)


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def event(ws, timeout: float | None = None) -> dict:
    """The next server event; an ``error`` event raises."""
    msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    if msg["type"] == "error":
        raise RuntimeError(f"the server said {msg['code']}: {msg['message']}")
    return msg


async def write(ws, context_id: str, answer: str, words_per_s: float) -> None:
    async for word in fake_llm(answer, words_per_s):
        await send(ws, "input_text.append", context_id=context_id, text=word)
    await send(ws, "input_text.end", context_id=context_id)


async def speak(ws, player: Player, context_id: str, answer: str, words_per_s: float,
                interrupt_after: float | None = None) -> None:
    """Speak ``answer`` as it is written; with ``interrupt_after``, the user interrupts that many seconds after
    its first audio."""
    writer = asyncio.create_task(write(ws, context_id, answer, words_per_s))
    start, first, received, played, interrupted = time.perf_counter(), None, 0, player.played, False
    try:
        while True:
            due = None if first is None or interrupt_after is None else first + interrupt_after
            try:
                msg = await event(ws, None if due is None else max(0.0, due - time.perf_counter()))
            except asyncio.TimeoutError:
                print(f"  the user interrupts after {interrupt_after:g} s -> context.cancel")
                writer.cancel()  # the LLM stops writing, too
                player.stop()
                await send(ws, "context.cancel", context_id=context_id)
                interrupt_after, interrupted = None, True
                continue
            if msg["type"] == "audio.delta":
                pcm = base64.b64decode(msg["audio"])
                if first is None:
                    first = time.perf_counter()
                    print(f"  first audio {1e3 * (first - start):.0f} ms after the answer began")
                if not interrupted:  # after the interruption nothing is played
                    player.queue += pcm
                received += len(pcm) // 2
            elif msg["type"] == "speech.segment":
                print(f"  [{msg['start_s']:.2f}-{msg['end_s']:.2f} s] {msg['text'].strip()}")
            elif msg["type"] == "context.cancelled":
                print(f"{context_id}: cancelled, {received / RATE:.2f} s of audio received, "
                      f"{(player.played - played) / RATE:.2f} s played")
                return
            elif msg["type"] == "audio.done":
                print(f"{context_id}: done, {received / RATE:.2f} s of audio")
                return
    finally:
        writer.cancel()


def socket_url(url: str) -> str:
    """``ws://host:port`` (or ``http://``) -> the realtime route's address."""
    url = url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    return url if url.endswith(ROUTE) else url + ROUTE


async def converse(args: argparse.Namespace, path: str) -> float:
    """Two answers on one socket, the first interrupted; the seconds of audio played into ``path``."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with connect(socket_url(args.url), additional_headers=headers, open_timeout=30) as ws:
        await event(ws, 30)  # session.created
        settings = {"voice": args.voice} if args.seed is None else {"voice": args.voice, "seed": args.seed}
        await send(ws, "session.update", session=settings)
        session = (await event(ws, 30))["session"]
        print(f"session: voice {session.get('voice')}, {session.get('response_format')} 24 kHz")
        with wave.open(path, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(RATE)
            player = Player(wav)
            playing = asyncio.create_task(player.run())
            try:
                print("answer-1 (the user will interrupt it):")
                await speak(ws, player, "answer-1", FIRST_ANSWER, args.words_per_s, args.interrupt_after)
                print("answer-2, in a new context on the same socket:")
                await speak(ws, player, "answer-2", SECOND_ANSWER, args.words_per_s)
                await player.drain()
            finally:
                playing.cancel()
        await send(ws, "session.close")
    return player.played / RATE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (default: ws://127.0.0.1:8000)")
    ap.add_argument("--api-key", default=os.environ.get("CHATTTS_VELOCITY_API_KEY"),
                    help="the server's --api-key (default: $CHATTTS_VELOCITY_API_KEY, else none)")
    ap.add_argument("--voice", default="alloy", help="an OpenAI voice name, a speaker string or a voice id")
    ap.add_argument("--seed", type=int, default=None, help="the server's seed, for reproducible audio")
    ap.add_argument("--words-per-s", type=float, default=15.0, help="how fast the fake LLM writes (default: 15)")
    ap.add_argument("--interrupt-after", type=float, default=2.0,
                    help="seconds into the first answer's audio when the user interrupts (default: 2)")
    ap.add_argument("--out", default="agent_out", help="output folder (default: agent_out)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "voice_agent.wav")
    try:
        seconds = asyncio.run(converse(args, path))
    except (OSError, WebSocketException, RuntimeError, asyncio.TimeoutError) as e:
        print(f"error: {socket_url(args.url)}: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {path}: {seconds:.2f} s of audio")


if __name__ == "__main__":
    main()

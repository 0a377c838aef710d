"""A streaming client of the speech server with the ``openai`` SDK: the audio arrives as 24 kHz 16-bit PCM while it
is generated and is written to a wav file as it comes (a player would play it here).

    chattts-velocity serve                    # in another shell (--model DIR for a local checkpoint)
    python examples/openai_client.py --input "Hello from the speech server."
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --api-key KEY --voice nova

``--model`` here is the model *name* sent to the server (any name works: tts-1, gpt-4o-mini-tts, ...); the
weights are chosen when the server starts. Writes OUT/speech.wav."""

from __future__ import annotations

import argparse
import os
import sys
import time
import wave

from openai import APIError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 address")
    ap.add_argument("--api-key", default=os.environ.get("CHATTTS_VELOCITY_API_KEY", "unused"),
                    help="the server's --api-key (default: $CHATTTS_VELOCITY_API_KEY, else none needed)")
    ap.add_argument("--model", default="tts-1", help="model name sent to the server (default: tts-1)")
    ap.add_argument("--voice", default="alloy", help="an OpenAI voice name, a speaker string or a voice id")
    ap.add_argument("--input", default="Hello! This speech is streamed from the server as it is generated.")
    ap.add_argument("--seed", type=int, default=None, help="the server's seed extra, for reproducible audio")
    ap.add_argument("--out", default="client_out", help="output folder (default: client_out)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "speech.wav")
    start = time.perf_counter()
    try:
        size = stream_to_wav(OpenAI(base_url=args.base_url, api_key=args.api_key), args, path)
    except APIError as e:  # no server there, a refused key, a bad request: one line, as the CLI reports errors
        print(f"error: {args.base_url}: {e}", file=sys.stderr)
        sys.exit(2)
    seconds = time.perf_counter() - start
    print(f"wrote {path}: {size / 2 / 24000:.2f} s of audio in {seconds:.2f} s")


def stream_to_wav(client: OpenAI, args: argparse.Namespace, path: str) -> int:
    """The speech of ``args.input`` streamed as pcm into a wav at ``path``; the bytes of audio written."""
    extra = {"seed": args.seed} if args.seed is not None else None
    start, first, size = time.perf_counter(), None, 0
    with client.audio.speech.with_streaming_response.create(
        model=args.model, voice=args.voice, input=args.input, response_format="pcm", extra_body=extra,
    ) as response, wave.open(path, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        carry = b""  # a chunk may end in the middle of a 2-byte sample
        for chunk in response.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - start
                print(f"first audio after {1e3 * first:.0f} ms")
            data = carry + chunk
            whole = len(data) - len(data) % 2
            out.writeframes(data[:whole])
            carry, size = data[whole:], size + whole
    return size


if __name__ == "__main__":
    main()

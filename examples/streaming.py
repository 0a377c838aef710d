"""Streaming: ``chat.infer(..., stream=True)`` yields audio chunks while the rest is still being generated. Each
chunk is appended to a wav file as it arrives (no audio device needed; a player would play it here), and the
time to the first chunk is printed.

    python examples/streaming.py --text "A long answer that starts playing before it is finished."
    python examples/streaming.py --model DIR --device cpu --out stream_out

Writes OUT/streamed.wav (24 kHz mono, 16-bit)."""

from __future__ import annotations

import os
import time

import soundfile as sf

from _common import example_parser, load_chat, run


def main() -> None:
    ap = example_parser(__doc__, "stream_out", "audio tokens at most")
    ap.add_argument("--text", default="Streaming audio starts playing long before the whole answer is generated.")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    chat = load_chat(args)
    params = chat.InferCodeParams(spk_emb=chat.sample_random_speaker(), manual_seed=args.seed,
                                  max_new_token=args.max_new_token)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "streamed.wav")

    start = time.perf_counter()
    # one text, not split into sentences: one row per chunk ([1, n]); the refine pass is skipped for latency
    chunks = chat.infer([args.text], stream=True, split_text=False, skip_refine_text=True, params_infer_code=params)
    samples, count = 0, 0
    with sf.SoundFile(path, "w", samplerate=24000, channels=1, subtype="PCM_16") as out:
        for chunk in chunks:
            if count == 0:
                print(f"first chunk after {1e3 * (time.perf_counter() - start):.0f} ms ({chunk.shape[1]} samples)")
            out.write(chunk[0])
            out.flush()  # the file is playable up to here
            samples, count = samples + chunk.shape[1], count + 1
    seconds = time.perf_counter() - start
    print(f"wrote {path}: {count} chunks, {samples / 24000:.2f} s of audio in {seconds:.2f} s")
    chat.unload()


if __name__ == "__main__":
    run(main)

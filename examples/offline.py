"""Text to a wav file with ``chat.infer``, as with upstream ChatTTS.

    python examples/offline.py --text "Hello, world. 你好，世界。"
    python examples/offline.py --model DIR --device cpu --out offline_out

Loads the real weights (2Noise/ChatTTS from the Hugging Face cache, downloaded on first use) unless ``--model``
names a folder in the upstream ``asset/`` layout; writes ``OUT/offline.wav`` (24 kHz mono)."""

from __future__ import annotations

import os
import time

import soundfile as sf

from _common import example_parser, load_chat, run


def main() -> None:
    ap = example_parser(__doc__, "offline_out")
    ap.add_argument("--text", default="Hello, this is ChatTTS, spoken by the velocity engine.")
    ap.add_argument("--seed", type=int, default=42, help="manual_seed: the same seed gives the same audio")
    ap.add_argument("--no-refine", action="store_true", help="skip the text-refine pass (oral tags, pauses)")
    args = ap.parse_args()

    chat = load_chat(args)
    speaker = chat.sample_random_speaker()  # keep this string to reuse the voice
    params = chat.InferCodeParams(spk_emb=speaker, manual_seed=args.seed, max_new_token=args.max_new_token)
    refine = chat.RefineTextParams(manual_seed=args.seed)
    start = time.perf_counter()
    (wav,) = chat.infer(args.text, skip_refine_text=args.no_refine, params_infer_code=params,
                        params_refine_text=refine)  # the sentences are split, generated and joined: one wav
    seconds = time.perf_counter() - start

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "offline.wav")
    sf.write(path, wav, 24000)
    print(f"wrote {path}: {wav.size / 24000:.2f} s of audio in {seconds:.2f} s")
    chat.unload()


if __name__ == "__main__":
    run(main)

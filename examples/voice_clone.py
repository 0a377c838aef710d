"""Speak in the voice of a recording: a voice sample (a wav) and its transcript become ``spk_smp``/``txt_smp``
through ``chat.sample_audio_speaker``, then ``infer`` speaks new text in that voice.

    python examples/voice_clone.py --sample me.wav --transcript "What I say in me.wav." --text "New words."
    python examples/voice_clone.py --model DIR --device cpu --out clone_out

Without ``--sample`` it first synthesises a sample with a random speaker (written to OUT/sample.wav), so the
script runs on its own. The sample is mixed to mono and resampled to 24 kHz; writes OUT/cloned.wav."""

from __future__ import annotations

import os

import numpy as np
import soundfile as sf
import torch
import torchaudio

from _common import example_parser, load_chat, run

RATE = 24000


def load_sample(path: str) -> np.ndarray:
    """A 24 kHz mono float32 wav from any file soundfile reads."""
    wav, rate = sf.read(path, dtype="float32", always_2d=True)
    mono = torch.from_numpy(wav.mean(axis=1))
    if rate != RATE:
        mono = torchaudio.functional.resample(mono, rate, RATE)
    return mono.numpy()


def main() -> None:
    ap = example_parser(__doc__, "clone_out")
    ap.add_argument("--sample", default=None, help="the voice to clone: a recording, ideally 3-30 s")
    ap.add_argument("--transcript", default="This is the voice that will be cloned.",
                    help="what is said in the sample")
    ap.add_argument("--text", default="And these are new words, in the same voice.")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    chat = load_chat(args)
    os.makedirs(args.out, exist_ok=True)
    sample_path = args.sample
    if sample_path is None:
        sample_path = os.path.join(args.out, "sample.wav")
        torch.manual_seed(args.seed)  # the random speaker too: the same sample every run
        # a sample of at least 24 tokens (half a second): a voice is not cloned from a click
        params = chat.InferCodeParams(spk_emb=chat.sample_random_speaker(), manual_seed=args.seed,
                                      min_new_token=min(24, args.max_new_token), max_new_token=args.max_new_token)
        sf.write(sample_path, chat.infer(args.transcript, skip_refine_text=True, params_infer_code=params)[0], RATE)
        print(f"no --sample given: synthesised {sample_path} to clone")

    spk_smp = chat.sample_audio_speaker(load_sample(sample_path))  # DVAE codes of the sample, as a string
    params = chat.InferCodeParams(spk_smp=spk_smp, txt_smp=args.transcript, manual_seed=args.seed,
                                  max_new_token=args.max_new_token)
    wav = chat.infer(args.text, skip_refine_text=True, params_infer_code=params)[0]
    path = os.path.join(args.out, "cloned.wav")
    sf.write(path, wav, RATE)
    print(f"wrote {path}: {wav.size / RATE:.2f} s in the voice of {sample_path}")
    chat.unload()


if __name__ == "__main__":
    run(main)

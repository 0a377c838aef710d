"""``chattts-velocity say``: one text to one audio file (wav, flac, mp3 or ogg, by the output's extension, through
the libsndfile encoders ``synth`` uses). Over random weights (``--dummy``, or a test-size checkpoint as
``make-checkpoint`` writes), which seldom or never end a sentence, each pass stops at ``RANDOM_MAX_NEW_TOKEN``
tokens unless ``--max-new-token`` says otherwise."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
import soundfile as sf

from .chat import Chat
from .constants import SAMPLE_RATE, SAMPLES_PER_TOKEN
from .model.gpt_config import FULL_GPT, GPTConfig
from .synth import FORMATS

RANDOM_MAX_NEW_TOKEN = 48
"""``say``'s default length per pass over random weights: they seldom or never sample EOS, so every pass runs
to it."""
MAX_NEW_TOKEN = 2048
"""``say``'s default length per pass over real weights (upstream's)."""


def say(args: argparse.Namespace, load: Callable[[], Chat]) -> int:
    """Run ``say`` with its parsed options; ``load`` loads the chat (after the output was checked)."""
    fmt = say_format(args.output)
    check_writable(args.output)  # before loading and synthesising, not after
    if args.dummy and args.max_new_token is None:  # said before the full-size random model's long load
        _capped("--dummy: random weights never end a sentence")
    chat = load()
    max_new = args.max_new_token
    if max_new is None:
        config = chat.model.config
        max_new = RANDOM_MAX_NEW_TOKEN if args.dummy or is_test_size(config) else MAX_NEW_TOKEN
        if not args.dummy and max_new == RANDOM_MAX_NEW_TOKEN:
            _capped(f"--model {args.model}: a test-size checkpoint (hidden size {config.hidden_size}, ChatTTS's "
                    f"{FULL_GPT.hidden_size}; make-checkpoint writes them), whose random weights rarely end a "
                    "sentence")
    speaker = args.speaker
    if speaker is None and args.random_speaker:
        speaker = chat.sample_random_speaker()
    code = Chat.InferCodeParams(spk_emb=speaker, manual_seed=args.seed, prompt=args.prompt, max_new_token=max_new)
    refine = Chat.RefineTextParams(manual_seed=args.seed, max_new_token=min(max_new, 384))
    wavs = chat.infer(args.text, skip_refine_text=args.no_refine, params_infer_code=code,
                      params_refine_text=refine)
    audio = np.concatenate(wavs) if wavs else np.zeros(0, dtype=np.float32)
    container, subtype = FORMATS[fmt]
    sf.write(args.output, audio, SAMPLE_RATE, format=container, subtype=subtype)
    print(f"wrote {args.output}: {audio.size / SAMPLE_RATE:.2f} s of audio at {SAMPLE_RATE} Hz")
    return 0


def _capped(why: str) -> None:
    seconds = RANDOM_MAX_NEW_TOKEN * SAMPLES_PER_TOKEN / SAMPLE_RATE
    print(f"{why}, so each pass stops at {RANDOM_MAX_NEW_TOKEN} tokens (~{seconds:.1f} s of noise per sentence); "
          "--max-new-token N for more", flush=True)


def say_format(path: str) -> str:
    """The format ``say`` writes to ``path``, from its extension: one of ``synth``'s ``FORMATS``."""
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"output must end in {', '.join('.' + f for f in FORMATS)}, got {path!r}")
    if FORMATS[fmt][0] not in sf.available_formats():
        raise ValueError(f"this libsndfile ({sf.__libsndfile_version__}) cannot write {fmt} (mp3 needs libsndfile "
                         ">= 1.1.0): choose another extension or upgrade soundfile")
    return fmt


def is_test_size(config: GPTConfig) -> bool:
    """A GPT smaller than ChatTTS's, as ``make-checkpoint`` writes for tests: its weights are random."""
    return config.hidden_size < FULL_GPT.hidden_size or config.num_hidden_layers < FULL_GPT.num_hidden_layers


def check_writable(path: str) -> None:
    """Create the folder of ``path`` and make sure the file can be written (what existed stays as it was)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "ab"):
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ValueError(f"cannot write {path!r}: {e.strerror or e}; choose another -o/--output") from None

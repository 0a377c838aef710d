"""How close incremental streaming decode (``chattts_velocity.audio.AudioStream``) comes to the offline decode,
per left context L and look-ahead R, on full-size random weights (CPU is fine):

    python benchmarks/stream_snr.py [--model DIR] [--tokens 300]

Prints a markdown table of the SNR (dB) of the streamed against the offline wav, for the Decoder (hidden
states) and the DVAE (codes), and the receptive field three ways: from the architecture (conv kernels and the
iSTFT window), by perturbation (how far one changed token moves any output sample at all), and the smallest
L = R whose streamed audio equals the offline one within float32 noise (the error left at L = R = the
architectural field, where only rounding differs).

Inputs are random: hidden states are standard normal (unit RMS, like the GPT's final-RMSNorm output), codes
uniform in [0, 625). Random weights make noise, not speech, but the receptive field and the boundary errors are
properties of the architecture and of weight scales like the real ones.
"""

from __future__ import annotations

import argparse
import math
import tempfile

import numpy as np
import torch

from chattts_velocity import Chat
from chattts_velocity.audio import AudioDecoder, AudioStream, StreamConfig, decode_windows
from chattts_velocity.model.checkpoint import write_checkpoint

SWEEP = (0, 2, 4, 8, 16, 24, 32, 52)


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """10 log10(signal / error energy); inf when equal."""
    err = np.sum((ref.astype(np.float64) - got) ** 2)
    return math.inf if err == 0 else 10 * math.log10(np.sum(ref.astype(np.float64) ** 2) / err)


def stream_decode(audio: AudioDecoder, tokens: torch.Tensor, config: StreamConfig, use_decoder: bool):
    """All tokens pushed at once: the windows are the same as for any push pattern. -> (wav, decoded_tokens)."""
    stream = AudioStream(config)
    stream.push(tokens, finished=True)
    windows = stream.ready()
    wavs = decode_windows(audio, windows, use_decoder)
    return np.concatenate(
        [stream.accept(w, wav) for w, wav in zip(windows, wavs, strict=True)]
    ), stream.decoded_tokens


def architectural_field(audio: AudioDecoder, use_decoder: bool) -> int:
    """Tokens on each side that can reach a sample: the mel-frame reach of every conv on the decode path plus
    the iSTFT's window, halved (2 frames per token)."""
    mel = audio.decoder if use_decoder else audio.dvae
    convs = [m for part in (mel.decoder, mel.out_conv, audio.vocos.backbone) for m in part.modules()]
    reach = sum((m.kernel_size[0] - 1) * m.dilation[0] // 2 for m in convs if isinstance(m, torch.nn.Conv1d))
    head = audio.vocos.head
    reach += head.istft.n_fft // (2 * head.istft.hop_length)
    return math.ceil(reach / 2)


def perturbation_field(audio: AudioDecoder, tokens: torch.Tensor, use_decoder: bool) -> tuple[int, int]:
    """Change the middle token; (before, after): how many tokens away the first and last changed sample lie."""
    k = tokens.shape[0] // 2
    moved = tokens.clone()
    moved[k] = random_tokens(1, tokens.shape[1], use_decoder, seed=1)[0]
    ref, got = audio.to_wavs([tokens], use_decoder)[0], audio.to_wavs([moved], use_decoder)[0]
    changed = np.nonzero(ref != got)[0]
    return k - int(changed.min()) // 512, int(changed.max()) // 512 - k


def smallest_exact(audio: AudioDecoder, tokens: torch.Tensor, use_decoder: bool, field: int) -> int:
    """Smallest L = R within twice the float32 noise (the error at L = R = ``field``), by bisection: the error
    only shrinks as the context grows."""
    ref = audio.to_wavs([tokens], use_decoder)[0]

    def error(n: int) -> float:
        return float(np.abs(stream_decode(audio, tokens, StreamConfig(n, n), use_decoder)[0] - ref).max())

    noise = error(field)
    lo, hi = 0, field  # error(hi) is within the noise; error(lo - 1) is not
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if error(mid) <= 2 * noise else (mid + 1, hi)
    return lo


def random_tokens(n: int, hidden: int, use_decoder: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if use_decoder:
        return torch.randn(n, hidden, generator=gen)  # [n, H]
    return torch.randint(0, 625, (n, 4), generator=gen)  # [n, 4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", help="an upstream-layout model folder (default: a full-size random checkpoint)"
    )
    ap.add_argument("--tokens", type=int, default=300, help="tokens per test utterance")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_checkpoint(tmp, size="full", seed=0)
        chat = Chat()
        chat.load(source="custom", custom_path=model_dir, device="cpu")
    audio, hidden = chat.audio, chat.model.config.hidden_size
    inputs = {ud: random_tokens(args.tokens, hidden, ud, seed=0) for ud in (True, False)}
    offline = {ud: audio.to_wavs([inputs[ud]], ud)[0] for ud in (True, False)}
    configs = [StreamConfig(n, n) for n in SWEEP] + [StreamConfig()]
    print(f"{args.tokens} random tokens; first_chunk={configs[0].first_chunk}, chunk={configs[0].chunk}\n")
    print("| L | R | SNR Decoder (dB) | SNR DVAE (dB) | decoded tokens / T |")
    print("|---|---|---|---|---|")
    for config in configs:
        row = []
        for ud in (True, False):
            wav, work = stream_decode(audio, inputs[ud], config, ud)
            assert wav.shape == offline[ud].shape, (wav.shape, offline[ud].shape)
            row.append(f"{snr_db(offline[ud], wav):.1f}")
        print(
            f"| {config.left_context} | {config.lookahead} | {' | '.join(row)} | {work / args.tokens:.2f} |"
        )
    print("\nreceptive field (tokens each side):")
    for ud, name in ((True, "Decoder"), (False, "DVAE")):
        field = architectural_field(audio, ud)
        before, after = perturbation_field(audio, inputs[ud], ud)
        exact = smallest_exact(audio, inputs[ud], ud, field)
        print(
            f"- {name}: architecture {field}; one token moves any sample (bitwise) up to {before} tokens before "
            f"and {after} after; streamed == offline within float32 noise from L = R = {exact}"
        )


if __name__ == "__main__":
    main()

"""Why a stream's window decode waits for the engine: with one request generating on the shared engine,
time a 16-token window decode on the audio stream, stage by stage, and how many iterations a bare Python
loop gets through in 50 ms (GIL starvation), against the same with the engine idle. Variants: as is (the
engine on its own CUDA stream), and with the engine thread issuing its work on the legacy default stream
(as it did before: the decoder stage then waited for the whole generation).

    python benchmarks/decode_contention.py
"""

from __future__ import annotations

import threading
import time

import torch

from chattts_velocity.bench.stream import StreamBenchConfig, load_chat
from chattts_velocity.engine import Prompt, SamplingParams


def spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def probe(chat, label: str) -> None:
    hidden = torch.randn(16, chat.model.config.hidden_size, device=chat.device)
    with chat.audio.stream():
        chat.audio.to_wavs([hidden], True)
    idle_spin = spin(0.05)
    idle_decode = staged(chat, hidden)
    ids, _, mask = chat.model.tokenizer.encode(["[Stts][empty_spk]probe sentence[Ptts]"], 4)
    p = SamplingParams(seed=0, max_new_tokens=400, min_new_tokens=400)
    stream = chat.engine.add_request(Prompt(ids[0], mask[0]), p)
    consumer = threading.Thread(target=lambda: [None for _ in stream])
    consumer.start()
    time.sleep(0.05)
    busy_spin = spin(0.05)
    busy_decode = staged(chat, hidden)
    consumer.join()
    print(f"{label}: decode stages (ms) idle {idle_decode}, while generating {busy_decode}; "
          f"python loop iterations in 50 ms idle {idle_spin}, while generating {busy_spin}")


@torch.inference_mode()
def staged(chat, hidden) -> dict:
    """Host time of each stage of a window decode on the audio stream (ms)."""
    audio, marks = chat.audio, [time.perf_counter()]
    with audio.stream():
        batch, _ = audio._pad([hidden])
        marks.append(time.perf_counter())
        mel = audio.decoder.decode(batch)
        marks.append(time.perf_counter())
        wav = audio.vocos.decode(mel)
        marks.append(time.perf_counter())
        wav.float().cpu()
        marks.append(time.perf_counter())
    names = ("pad", "decoder", "vocos", "to_host")
    return {n: round(1e3 * (b - a), 1) for n, a, b in zip(names, marks[:-1], marks[1:], strict=True)}


def main() -> None:
    chat = load_chat(StreamBenchConfig(), 8)
    probe(chat, "warm-up")
    probe(chat, "as is")
    chat.engine.shutdown(drain=True)
    chat.engine._stopping = False
    chat.engine._run = chat.engine._loop  # without its own stream
    probe(chat, "engine on the legacy default stream")
    chat.unload()


if __name__ == "__main__":
    main()

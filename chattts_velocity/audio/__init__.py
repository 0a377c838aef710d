"""Audio side of ChatTTS: DVAE (codes <-> mel), Decoder (hidden states -> mel), Vocos (mel -> 24 kHz wav)."""

from __future__ import annotations

from .decode import AudioDecoder
from .dvae import DVAE, ConvStackConfig, DVAEConfig
from .pump import AudioPump, Delivery, Feed
from .stream import AudioStream, StreamConfig, Window, decode_windows
from .vocoder import load_vocos, vocos_state_dict_config

__all__ = [
    "DVAE",
    "AudioDecoder",
    "AudioPump",
    "AudioStream",
    "ConvStackConfig",
    "DVAEConfig",
    "Delivery",
    "Feed",
    "StreamConfig",
    "Window",
    "decode_windows",
    "load_vocos",
    "vocos_state_dict_config",
]

"""ChatTTS's fixed facts: the upstream asset layout, where the weights are published, and the audio rate."""

from __future__ import annotations

# Upstream asset layout, relative to the model folder (Hugging Face repo ``2Noise/ChatTTS``).
ASSET_FILES = {
    "gpt": "asset/gpt",
    "embed": "asset/Embed.safetensors",
    "dvae": "asset/DVAE.safetensors",
    "decoder": "asset/Decoder.safetensors",
    "vocos": "asset/Vocos.safetensors",
    "tokenizer": "asset/tokenizer",
}
# Not in the upstream repo: random checkpoints carry their speaker statistics here (std, mean; float16).
SPK_STAT_FILE = "asset/spk_stat.safetensors"
HF_REPO_ID = "2Noise/ChatTTS"

SAMPLE_RATE = 24000
"""Samples per second of every waveform (Vocos' output)."""
HOP_LENGTH = 256
"""Samples per mel frame."""
SAMPLES_PER_TOKEN = 2 * HOP_LENGTH
"""One GPT token = 2 mel frames: 512 samples at 24 kHz."""

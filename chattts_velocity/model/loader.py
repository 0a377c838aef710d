"""ModelLoader: find the ChatTTS assets (Hugging Face ``2Noise/ChatTTS``, a local folder or a custom path),
read them with every size inferred from the files, or build full-size random weights (``load_format="dummy"``).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..audio import DVAE, load_vocos
from ..constants import ASSET_FILES, HF_REPO_ID, SPK_STAT_FILE
from ..text import SpeakerStats, Tokenizer
from ..weights import load_checked, read_safetensors, read_safetensors_dir
from .checkpoint import FULL, build_modules, random_llama_state
from .gpt import ChatGPT
from .gpt_config import FULL_GPT, GPTConfig

logger = logging.getLogger(__name__)
SOURCES = ("huggingface", "local", "custom")
HOW_TO_GET = (
    f"Download the weights with `hf download {HF_REPO_ID}` (huggingface_hub's command line; needs internet), "
    "pass a folder with the upstream asset/ layout (`--model DIR`, or `Chat.load(source='custom', "
    "custom_path=DIR)`), or use random weights offline (`--dummy`, `load_format='dummy'`)."
)


class ModelNotFoundError(FileNotFoundError):
    """No complete ChatTTS checkpoint where we looked; the message says where and how to get one."""


def _raise_if_incomplete(root: Path) -> None:
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise ModelNotFoundError(f"no such folder: {root} {what}; the model folder must hold the upstream asset/ "
                                 f"layout ({', '.join(ASSET_FILES.values())}). {HOW_TO_GET}")
    missing = missing_assets(root)
    if missing:
        raise ModelNotFoundError(f"incomplete ChatTTS checkpoint in {root}: missing {', '.join(missing)}. {HOW_TO_GET}")


def missing_assets(root: str | os.PathLike) -> list[str]:
    """Upstream-layout entries absent under ``root`` (empty when the checkpoint is complete)."""
    root = Path(root)
    missing = [rel for rel in ASSET_FILES.values() if not (root / rel).exists()]
    gpt = root / ASSET_FILES["gpt"]
    if gpt.is_dir() and not (gpt / "config.json").exists():
        missing.append(f"{ASSET_FILES['gpt']}/config.json")
    if gpt.is_dir() and not list(gpt.glob("*.safetensors")):
        missing.append(f"{ASSET_FILES['gpt']}/*.safetensors")
    return missing


def _hub_snapshot(cache_dir: str | None, force: bool) -> Path | None:
    """The newest complete snapshot of ``2Noise/ChatTTS`` in the Hugging Face cache (``HF_HOME``), or download."""
    from huggingface_hub import snapshot_download

    kwargs = dict(repo_id=HF_REPO_ID, allow_patterns=["*.yaml", "*.json", "*.safetensors"], cache_dir=cache_dir)
    if not force:
        try:
            path = Path(snapshot_download(**kwargs, local_files_only=True))
            if not missing_assets(path):
                return path
        except Exception as e:  # noqa: BLE001 - any cache miss falls through to the scan and the download
            logger.debug("no cached snapshot via refs: %s", e)
        found = _scan_snapshots(cache_dir)
        if found is not None:
            return found
    try:
        logger.info("downloading %s from Hugging Face", HF_REPO_ID)
        path = Path(snapshot_download(**kwargs, force_download=force))
    except Exception as e:  # noqa: BLE001 - offline, no network, gated...: reported with where we looked
        logger.warning("download of %s failed: %s", HF_REPO_ID, e)
        return None
    return path if not missing_assets(path) else None


def _hub_cache_dir(cache_dir: str | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _scan_snapshots(cache_dir: str | None) -> Path | None:
    """Upstream's fallback: the most recently modified complete snapshot folder."""
    snaps = _hub_cache_dir(cache_dir) / f"models--{HF_REPO_ID.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    complete = [p for p in snaps.iterdir() if p.is_dir() and not missing_assets(p)]
    return max(complete, key=lambda p: p.stat().st_mtime) if complete else None


def resolve_model_dir(source: str = "local", custom_path: str | os.PathLike | None = None,
                      force_redownload: bool = False) -> Path:
    """The folder holding ``asset/``, per upstream's three sources:

    - ``huggingface``: the Hugging Face cache (``HF_HOME``, or ``custom_path`` as cache dir), downloading if absent;
    - ``local``: ``custom_path`` or the working directory, filled from Hugging Face if incomplete;
    - ``custom``: ``custom_path`` exactly; never downloads.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "huggingface":
        path = _hub_snapshot(None if custom_path is None else str(custom_path), force_redownload)
        if path is None:
            raise ModelNotFoundError(
                f"ChatTTS weights not found in the Hugging Face cache {_hub_cache_dir(custom_path)} and could not "
                f"be downloaded. {HOW_TO_GET}"
            )
        return path
    if source == "custom" and custom_path is None:
        raise ValueError("source='custom' needs custom_path: the folder that holds asset/")
    root = Path(custom_path if custom_path is not None else os.getcwd())
    if source == "local" and (missing_assets(root) or force_redownload):
        _download_into(root)
    _raise_if_incomplete(root)
    return root


def _download_into(root: Path) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=HF_REPO_ID, allow_patterns=["*.yaml", "*.json", "*.safetensors"], local_dir=root)
    except Exception as e:  # noqa: BLE001 - reported by the caller with the list of missing files
        logger.warning("download of %s into %s failed: %s", HF_REPO_ID, root, e)


@dataclass
class LoadedModel:
    """Everything a ``Chat`` needs, on one device."""

    config: GPTConfig
    gpt: ChatGPT
    tokenizer: object
    dvae: torch.nn.Module
    decoder: torch.nn.Module
    vocos: torch.nn.Module
    speaker_stats: object | None
    root: Path | None


class ModelLoader:
    """Reads a checkpoint folder (``load_format="safetensors"``) or builds random full-size weights (``"dummy"``)."""

    def __init__(self, device: torch.device | str = "cpu", load_format: str = "safetensors"):
        if load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
        self.device = torch.device(device)
        self.load_format = load_format

    def load(self, root: str | os.PathLike | None = None, seed: int = 0) -> LoadedModel:
        if self.load_format == "dummy":
            return self._load_dummy(seed)
        if root is None:
            raise ValueError("ModelLoader.load needs the checkpoint folder for load_format='safetensors'")
        root = Path(root)
        _raise_if_incomplete(root)
        return self._load_files(root)

    def _load_files(self, root: Path) -> LoadedModel:
        gpt_dir = root / ASSET_FILES["gpt"]
        embed_sd = read_safetensors(root / ASSET_FILES["embed"])
        config = _gpt_config(gpt_dir, embed_sd)
        tokenizer = Tokenizer(root / ASSET_FILES["tokenizer"])
        if tokenizer.len != config.num_text_tokens:
            raise ValueError(f"tokenizer has {tokenizer.len} tokens but Embed.safetensors has "
                             f"{config.num_text_tokens} text embeddings: tokenizer and weights do not match")
        gpt = ChatGPT(config)
        load_checked(gpt.llama, _llama_state(read_safetensors_dir(gpt_dir)), f"{gpt_dir}/*.safetensors")
        gpt.llama_source = functools.partial(_read_llama, gpt_dir)
        load_checked(gpt.embed, embed_sd, "Embed.safetensors")
        return LoadedModel(
            config=config,
            gpt=gpt.to(self.device).eval(),
            tokenizer=tokenizer,
            dvae=DVAE.from_file(root / ASSET_FILES["dvae"], self.device).eval(),
            decoder=DVAE.from_file(root / ASSET_FILES["decoder"], self.device).eval(),
            vocos=load_vocos(root / ASSET_FILES["vocos"], self.device).eval(),
            speaker_stats=_speaker_stats(root, config.hidden_size),
            root=root,
        )

    def _load_dummy(self, seed: int) -> LoadedModel:
        """Full-size random weights in memory (vLLM's ``load_format="dummy"``), for benchmarks and offline demos."""
        with tempfile.TemporaryDirectory() as tmp:
            mods = build_modules(FULL, seed, tokenizer_dir=tmp)
        mods.gpt.llama_source = functools.partial(random_llama_state, mods.config, seed)
        dev = self.device
        return LoadedModel(config=mods.config, gpt=mods.gpt.to(dev).eval(), tokenizer=mods.tokenizer,
                           dvae=mods.dvae.to(dev).eval(), decoder=mods.decoder.to(dev).eval(),
                           vocos=mods.vocos.to(dev).eval(), speaker_stats=mods.speaker_stats, root=None)


def _gpt_config(gpt_dir: Path, embed_sd: dict[str, torch.Tensor]) -> GPTConfig:
    """config.json for the Llama core; vocabularies and codebook count from Embed.safetensors' shapes."""
    base = GPTConfig.from_json(gpt_dir / "config.json")
    try:
        text_rows, hidden = embed_sd["emb_text.weight"].shape
        audio_rows = embed_sd["emb_code.0.weight"].shape[0]
    except (KeyError, ValueError):
        raise ValueError("Embed.safetensors: needs emb_text.weight [V_text, H] and emb_code.{q}.weight") from None
    num_vq = sum(1 for k in embed_sd if k.startswith("emb_code.") and k.endswith(".weight"))
    if hidden != base.hidden_size:
        raise ValueError(f"Embed.safetensors has hidden size {hidden} but asset/gpt/config.json says "
                         f"{base.hidden_size}: the files come from different models")
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    fields.update(num_text_tokens=text_rows, num_audio_tokens=audio_rows, num_vq=num_vq)
    return GPTConfig(**fields)


def _read_llama(gpt_dir: Path) -> dict[str, torch.Tensor]:
    """The Llama's weights read again from ``asset/gpt`` (for ``ChatGPT.ensure_llama``)."""
    try:
        return _llama_state(read_safetensors_dir(gpt_dir))
    except OSError as e:
        raise RuntimeError(f"re-reading the reference model's weights from {gpt_dir}: {e}") from None


def _llama_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip a ``model.`` prefix and drop the unused token embedding (ChatTTS feeds embeddings)."""
    out = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        if not k.startswith("embed_tokens.") and not k.startswith("lm_head."):
            out[k] = v
    return out


def _speaker_stats(root: Path, hidden: int):
    """Speaker statistics: the checkpoint's own file, else upstream's built-in ones for the 768-wide model."""
    path = root / SPK_STAT_FILE
    if path.exists():
        sd = read_safetensors(path)
        if "std" not in sd or "mean" not in sd or sd["std"].shape != (hidden,) or sd["mean"].shape != (hidden,):
            raise ValueError(f"{path}: needs float16 tensors 'std' and 'mean' of shape ({hidden},)")
        for key in ("std", "mean"):
            if not sd[key].is_floating_point():
                raise ValueError(f"{path}: {key} has dtype {sd[key].dtype}, expected float16")
        return SpeakerStats(sd["std"].to(torch.float16), sd["mean"].to(torch.float16))
    if hidden == FULL_GPT.hidden_size:
        return SpeakerStats.builtin_768()
    return None

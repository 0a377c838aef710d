"""The web demo tests' machine without ffmpeg: PATH with the folders that hold one dropped, so the page must bring
its own (the ``imageio-ffmpeg`` wheel of the ``webui`` extra)."""

from __future__ import annotations

import os
import shutil

import pytest


def path_without_ffmpeg(path: str) -> str:
    """``path`` without its folders that hold an ``ffmpeg``."""
    return os.pathsep.join(d for d in path.split(os.pathsep) if d and shutil.which("ffmpeg", path=d) is None)


def bundled_ffmpeg() -> str | None:
    """imageio-ffmpeg's own binary, or None where the wheel has none for this platform (its fallback, a system
    ffmpeg, is not counted)."""
    import imageio_ffmpeg

    saved = os.environ["PATH"]
    os.environ["PATH"] = path_without_ffmpeg(saved)
    try:
        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        return None
    finally:
        os.environ["PATH"] = saved
    return exe if os.path.isabs(exe) else None


def require_ffmpeg() -> None:
    """Skip, saying why, where no ffmpeg can be found for Gradio's streamed audio."""
    if shutil.which("ffmpeg") is None:
        pytest.skip("no ffmpeg for Gradio's streamed audio: none on PATH and imageio-ffmpeg (the webui extra) has "
                    "no binary for this platform; install FFmpeg")

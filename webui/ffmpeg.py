"""An ``ffmpeg`` for Gradio's streamed audio: Gradio (and pydub under it) runs the command ``ffmpeg`` found on
PATH, so where the system has none, the binary of the ``imageio-ffmpeg`` wheel (in the ``webui`` extra) is linked
under that name into a folder of this process, put first on PATH."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

COMMAND = "ffmpeg.exe" if os.name == "nt" else "ffmpeg"


def ensure_ffmpeg() -> str | None:
    """The ``ffmpeg`` that Gradio will run: the system's if PATH has one, else imageio-ffmpeg's, put on PATH
    (this process's, inherited by its children). None, with a warning, where there is neither: the page then
    works but Stream mode fails with Gradio's message."""
    found = shutil.which("ffmpeg")
    if found is not None:
        return found
    try:
        import imageio_ffmpeg

        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError) as e:
        logger.warning("no ffmpeg on PATH and none from imageio-ffmpeg (%s): Stream mode needs one; install "
                       "FFmpeg, or the web demo's extra: pip install -e \".[webui]\" from a clone, or "
                       "\"chattts-velocity[webui]\" from an index", e)
        return None
    folder = tempfile.mkdtemp(prefix="chattts-velocity-ffmpeg-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _link(exe, os.path.join(folder, COMMAND))
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ffmpeg")


def _link(target: str, name: str) -> None:
    """``name`` runs ``target``: a symbolic link, or a copy where links are not allowed (Windows without the
    privilege)."""
    try:
        os.symlink(target, name)
    except OSError:
        shutil.copy2(target, name)

"""The Gradio web demo (``chattts-velocity webui``): ChatTTS's own web UI over the shared engine, many visitors
batched together. Installed as ``chattts_velocity.webui`` from the top-level folder ``webui/`` (pyproject.toml's
``package-dir``; a bare top-level ``webui`` would clash with other distributions); it uses the package by its
absolute names and public API only. Needs the ``webui`` extra (Gradio)."""

from __future__ import annotations

from .app import build_demo, launch
from .config import DemoConfig

__all__ = ["DemoConfig", "build_demo", "launch"]

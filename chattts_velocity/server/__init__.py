"""The OpenAI-compatible speech server (``chattts-velocity serve``; needs ``pip install -e ".[server]"`` from a
clone, or ``"chattts-velocity[server]"``):
``build_app`` over an ``EngineClient`` (``app.py``), launched in one of its topologies by ``run.launch`` as
``ServeSettings`` say (``settings.py``)."""

from __future__ import annotations

from .settings import ScaleConfig, ServerConfig, ServeSettings

__all__ = ["ScaleConfig", "ServeSettings", "ServerConfig", "build_app"]


def __getattr__(name: str):
    if name == "build_app":  # FastAPI is an optional dependency: imported when asked for
        from .app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

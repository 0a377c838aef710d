"""The OpenAI-compatible speech server (``chattts-velocity serve``; needs ``pip install "chattts-velocity[server]"``)."""

from .config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def build_app(chat, config: ServerConfig | None = None, cluster=None):
    """The FastAPI app over a loaded ``Chat`` (imported lazily: FastAPI is an optional dependency)."""
    from .app import build_app as build

    return build(chat, config, cluster)

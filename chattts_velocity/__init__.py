"""chattts_velocity: the fastest way to run ChatTTS, behind ChatTTS's own API."""

from __future__ import annotations

from .chat import Chat
from .params import InferCodeParams, RefineTextParams

__version__ = "0.1.0"
__all__ = ["Chat", "InferCodeParams", "RefineTextParams", "__version__"]

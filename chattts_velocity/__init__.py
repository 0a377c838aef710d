"""chattts_velocity: the fastest way to run ChatTTS, behind ChatTTS's own API."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Chat", "InferCodeParams", "RefineTextParams", "__version__"]

if TYPE_CHECKING:
    from .chat import Chat
    from .params import InferCodeParams, RefineTextParams

_LAZY = {"Chat": "chat", "InferCodeParams": "params", "RefineTextParams": "params"}


def __getattr__(name: str):
    """``Chat`` and the parameter classes, imported at first use: a process that needs only a light part of the
    package (a bench client, a front's HTTP side) does not pay for torch and the model code it never runs."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

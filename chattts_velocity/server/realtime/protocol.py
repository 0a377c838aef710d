"""The realtime socket's wire protocol (``/v1/audio/speech/stream``, JSON text frames): each client frame parsed
into one typed message, the session's settings validated with the HTTP route's own request schema (the same
limits), and every refusal as one ``ProtocolError`` that the session sends as an ``error`` event.

Client messages: ``session.update`` (settings), ``input_text.append`` / ``input_text.flush`` /
``input_text.end`` / ``context.cancel`` (by ``context_id``), ``session.close``, and ``auth`` (the API key, as
the first message only). Unknown fields beside ``type`` are ignored; unknown settings are refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..schema import SpeechRequest

MAX_CONTEXT_ID = 256
"""Longest ``context_id`` accepted."""

SESSION_FIELDS = ("voice", "response_format", "speed", "seed", "temperature", "top_p", "top_k", "prompt",
                  "refine_text")
"""What ``session.update`` may set, each validated as ``SpeechRequest``'s field of that name."""

DEFAULT_VOICE = "alloy"
"""A session's voice until ``session.update`` names another."""


class ProtocolError(Exception):
    """Why a message is refused: its ``code`` (the ``error`` event's), what to fix, and the context it was
    about (None: the socket's)."""

    def __init__(self, code: str, message: str, context_id: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.context_id = code, message, context_id
        self.param, self.retry_after_s = param, retry_after_s

    def event(self) -> dict:
        """The ``error`` event: ``{"type", "code", "message"}`` and, where known, ``context_id``, ``param``,
        ``retry_after_s``."""
        out: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message}
        extra = {"context_id": self.context_id, "param": self.param, "retry_after_s": self.retry_after_s}
        out.update({key: value for key, value in extra.items() if value is not None})
        return out


@dataclass(frozen=True)
class SessionUpdate:
    session: dict


@dataclass(frozen=True)
class AppendText:
    context_id: str
    text: str


@dataclass(frozen=True)
class Flush:
    context_id: str


@dataclass(frozen=True)
class End:
    context_id: str


@dataclass(frozen=True)
class Cancel:
    context_id: str


@dataclass(frozen=True)
class SessionClose:
    pass


@dataclass(frozen=True)
class Auth:
    api_key: str


Message = SessionUpdate | AppendText | Flush | End | Cancel | SessionClose | Auth

MESSAGES: dict[str, tuple[type, dict[str, type]]] = {
    "session.update": (SessionUpdate, {"session": dict}),
    "input_text.append": (AppendText, {"context_id": str, "text": str}),
    "input_text.flush": (Flush, {"context_id": str}),
    "input_text.end": (End, {"context_id": str}),
    "context.cancel": (Cancel, {"context_id": str}),
    "session.close": (SessionClose, {}),
    "auth": (Auth, {"api_key": str}),
}
"""Each message type: its class and its fields' JSON types (all required)."""


def parse(frame: str | bytes | None) -> Message:
    """One client frame as its message, or ``ProtocolError`` (invalid_json, invalid_message)."""
    if not isinstance(frame, str):
        raise ProtocolError("invalid_message", "send JSON text frames, not binary ones")
    try:
        data = json.loads(frame)
    except ValueError as e:
        raise ProtocolError("invalid_json", f"the frame is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_message", "a message is a JSON object with a 'type'")
    kind = data.get("type")
    if kind not in MESSAGES:
        raise ProtocolError("invalid_message", f"unknown message type {kind!r}: the types are {', '.join(MESSAGES)}")
    cls, fields = MESSAGES[kind]
    context_id = _context_id(data) if "context_id" in fields else None
    values = {}
    for name, typ in fields.items():
        value = data.get(name)
        if not isinstance(value, typ):
            have = "missing" if name not in data else f"a {type(value).__name__}"
            raise ProtocolError("invalid_message", f"{kind}: '{name}' must be a {_JSON_NAMES[typ]}, got {have}",
                                context_id, param=name)
        values[name] = value
    return cls(**values)


_JSON_NAMES = {str: "string", dict: "object"}


def _context_id(data: dict) -> str:
    value = data.get("context_id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CONTEXT_ID:
        have = "missing" if "context_id" not in data else repr(value)[:40]
        raise ProtocolError("invalid_message", f"{data['type']}: 'context_id' must be a string of 1 to "
                            f"{MAX_CONTEXT_ID} characters, got {have}", param="context_id")
    return value


def default_settings(model_name: str) -> SpeechRequest:
    """A new session's settings: the HTTP route's defaults, pcm, ``DEFAULT_VOICE``."""
    return SpeechRequest(model=model_name, input="", voice=DEFAULT_VOICE, response_format="pcm")


def updated_settings(current: SpeechRequest, update: dict) -> SpeechRequest:
    """``current`` with ``update`` (any of ``SESSION_FIELDS``) applied, validated as ``POST /v1/audio/speech``
    validates them, or ``ProtocolError``: invalid_settings, unsupported_format (a format other than pcm)."""
    unknown = sorted(set(update) - set(SESSION_FIELDS))
    if unknown:
        raise ProtocolError("invalid_settings", f"unknown setting {unknown[0]!r}: the settings are "
                            f"{', '.join(SESSION_FIELDS)}", param=unknown[0])
    try:
        body = SpeechRequest.model_validate({**current.model_dump(), **update})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ProtocolError("invalid_settings", f"{loc}: {first['msg']}", param=str(first["loc"][0])) from None
    if body.response_format != "pcm":
        raise ProtocolError("unsupported_format", f"response_format {body.response_format!r} is not streamed here: "
                            "the realtime route sends pcm (s16le, 24 kHz, mono)", param="response_format")
    if body.refine_text:
        raise ProtocolError("invalid_settings", "refine_text is not supported on the realtime route: the refine "
                            "pass needs the whole text", param="refine_text")
    return body


def settings_view(body: SpeechRequest) -> dict:
    """The effective settings, as ``session.created`` / ``session.updated`` show them."""
    return {name: getattr(body, name) for name in SESSION_FIELDS}

"""The realtime door: ``GET /v1/audio/speech/stream``, a WebSocket that speaks text as it is appended
(``route``: the endpoint and its auth; ``session``: one socket; ``protocol``: its messages; ``context``: one
context's speech, sentence by sentence)."""

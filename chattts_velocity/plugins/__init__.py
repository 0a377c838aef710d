"""Voice-agent framework plugins over the realtime socket (``GET /v1/audio/speech/stream``): ``livekit``
(LiveKit Agents, extra ``livekit``) and ``pipecat`` (pipecat, extra ``pipecat``); ``connection`` is the socket's
client side that both share."""

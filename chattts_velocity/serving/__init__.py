"""The engine seam (no HTTP here): ``client.EngineClient`` is what every front talks to; ``local.LocalClient``
serves it from a ``Chat`` in this process, ``engine_process.RemoteClient`` from an engine in a process of its
own. ``kit.SpeechKit`` prepares requests without the model, ``voices.VoiceRegistry`` resolves voices, and
``load.load_chat`` loads a model for serving."""

"""The engine in a process of its own: ``remote.RemoteClient`` (a front's side, an ``EngineClient``),
``host.engine_main`` and ``host.EngineHost`` (the engine process's side: why it runs apart is there),
``shipper`` (its audio), ``messages`` (what crosses the pipes). A launcher calls ``RemoteClient.start_engine``."""

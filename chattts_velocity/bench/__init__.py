"""``chattts-velocity bench``: the reference decode loop and the velocity engine side by side, in one run, on
random weights: per-step latency, throughput, audio seconds per wall second (GPT alone and with the wav
decode), time to first audio and peak memory, per batch size.

Modules: ``config`` (what to run), ``runner`` (the variants, and ``run_and_report``), ``paths`` (each path
timed step by step), ``measure`` (clocks, memory, the figures and their definitions, also written into the
JSON), ``report`` (JSON, table, chart), ``agreement`` (``bench agreement``: each CPU engine dtype's top-1
codes against the float32 engine's). Nothing heavy is imported here, so the CLI parser reads ``config``
cheaply."""

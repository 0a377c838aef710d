"""Keep what lives as long as the model out of the garbage collector's scans.

A full collection walks every tracked object: with a full-size model loaded (modules, parameters, the
tokenizer, the libraries' own objects) that is a long pause, which a large batched generation meets once or
twice; after ``freeze_long_lived`` the generation runs as fast as with the collector off
(`python benchmarks/gc_pauses.py`; docs/perf/)."""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect, then move every object alive now into the permanent generation (``gc.freeze``): later
    collections scan only what was created after. Frozen objects are still freed when their last reference
    goes; only cycles among them wait for ``thaw``."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Undo ``freeze_long_lived`` (before letting go of a model, so its cycles can be collected)."""
    gc.unfreeze()

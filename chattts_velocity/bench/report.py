"""The benchmark's outputs: the JSON file, the printed table (one line per batch, both paths and the speedups)
and the optional PNG chart."""

from __future__ import annotations

import json
import os

# (title, row key, show the speedup): what the printed table shows per batch, one line per path and one of
# speedups, so that it fits a 100-column terminal.
TABLE_COLUMNS = (
    ("step ms", "step_ms_p50", True),
    ("steps/s", "steps_per_s", False),
    ("tokens/s", "tokens_per_s", True),
    ("GPT s/s", "gpt_audio_s_per_s", False),
    ("e2e s/s", "e2e_audio_s_per_s", True),
    ("TTFA s", "ttfa_s", True),
    ("peak GiB", "peak_mem_gib", False),
)
TABLE_LEGEND = (
    "step ms: median time of one decode step (every running sequence advances one token)",
    "steps/s: tokens per sequence per second; tokens/s: all tokens generated over the run's wall time",
    "GPT s/s, e2e s/s: audio s per wall s, GPT alone / with the wav decode; TTFA: time to first audio",
    "speedup: velocity over reference (>1 is better). The step-time speedup leaves out what tokens/s",
    "pays for: the prefill, scheduling between steps, steps slower than the median (most at batch 1).",
)
CHART_PANELS = (
    ("tokens_per_s", "generated tokens/s (all sequences)"),
    ("e2e_audio_s_per_s", "audio s per wall s, incl. wav decode"),
    ("step_ms_p50", "decode step p50 (ms)"),
    ("ttfa_s", "time to first audio (s)"),
)
_WIDTH = 9


def require_matplotlib() -> None:
    """Fail before the (long) run when a chart is asked for but cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or leave out --plot)"
        ) from None


def prepare_output(path: str) -> None:
    """Create the folder of an output file up front, so a bad path fails before the run, not after it."""
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder; give a file path")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_json(report: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def format_table(report: dict) -> str:
    """Per batch, a line of each path's figures and one of the speedups (velocity over reference), then what
    the columns mean; under 100 columns."""
    rows = {(r["path"], r["batch"]): r for r in report["rows"]}
    speedups = {s["batch"]: s for s in report["speedups"]}
    lines = [" ".join(["batch", "path".ljust(9), *(title.rjust(_WIDTH) for title, _, _ in TABLE_COLUMNS)])]
    for batch in report["meta"]["batches"]:
        for path in ("reference", "velocity"):
            row = rows.get((path, batch), {})
            cells = [_fmt(row.get(key)) for _, key, _ in TABLE_COLUMNS]
            lines.append(_line(batch if path == "reference" else "", path, cells))
        up = speedups.get(batch, {})
        cells = [f"{up[key]:.1f}x" if ratio and key in up else "-" for _, key, ratio in TABLE_COLUMNS]
        lines.append(_line("", "speedup", cells))
    meta = report["meta"]
    lines.append(meta["device"])
    lines.append(f"{meta['size']} model, {meta['tokens']} tokens per sequence, engine {meta['dtype']}, reference "
                 f"{meta['reference_dtype']}")
    lines.extend(TABLE_LEGEND)
    return "\n".join(lines)


def _line(batch, path: str, cells: list[str]) -> str:
    return " ".join([str(batch).rjust(5), path.ljust(9), *(c.rjust(_WIDTH) for c in cells)])


def plot(report: dict, path: str) -> None:
    """A 2x2 chart of the main figures against the batch size, one line per path, log scales."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, CHART_PANELS, strict=True):
        for name in ("reference", "velocity"):
            points = sorted((r["batch"], r[key]) for r in report["rows"] if r["path"] == name)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set(title=title, xlabel="batch", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    meta = report["meta"]
    fig.suptitle(
        f"chattts-velocity bench: {meta['device']}, {meta['size']} model, {meta['tokens']} tokens, "
        f"engine {meta['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""The benchmark's outputs: the JSON file, the printed table (per batch, a line for the reference and, per
velocity dtype, a line of figures and one of speedups) and the optional PNG chart."""

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


SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8"}


def _labels(meta: dict) -> dict[str, tuple[str, str]]:
    """Per velocity dtype, its lines' path labels: "velocity" and "speedup", with the dtype when several run."""
    dtypes = meta.get("dtypes", [meta["dtype"]])
    if len(dtypes) == 1:
        return {dtypes[0]: ("velocity", "speedup")}
    return {d: (f"velocity {SHORT_DTYPES.get(d, d)}", f"speedup {SHORT_DTYPES.get(d, d)}") for d in dtypes}


def format_table(report: dict) -> str:
    """Per batch, a line of the reference's figures, then for each velocity dtype a line of its figures and one
    of its speedups over the reference, then what the columns mean; under 100 columns."""
    meta = report["meta"]
    labels = _labels(meta)
    width = max(9, *(len(label) for pair in labels.values() for label in pair))
    rows = {(r["path"], r.get("dtype"), r["batch"]): r for r in report["rows"]}
    speedups = {(s["batch"], s.get("dtype")): s for s in report["speedups"]}
    reference = {r["batch"]: r for r in report["rows"] if r["path"] == "reference"}
    lines = [" ".join(["batch", "path".ljust(width), *(title.rjust(_WIDTH) for title, _, _ in TABLE_COLUMNS)])]
    for batch in meta["batches"]:
        cells = [_fmt(reference.get(batch, {}).get(key)) for _, key, _ in TABLE_COLUMNS]
        lines.append(_line(batch, "reference", cells, width))
        for dtype, (velocity, speedup) in labels.items():
            row = rows.get(("velocity", dtype, batch), {})
            lines.append(_line("", velocity, [_fmt(row.get(key)) for _, key, _ in TABLE_COLUMNS], width))
            up = speedups.get((batch, dtype), {})
            cells = [f"{up[key]:.1f}x" if ratio and key in up else "-" for _, key, ratio in TABLE_COLUMNS]
            lines.append(_line("", speedup, cells, width))
    lines.append(meta["device"])
    lines.append(f"{meta['size']} model, {meta['tokens']} tokens per sequence, engine "
                 f"{', '.join(labels)}, reference {meta['reference_dtype']}")
    lines.extend(TABLE_LEGEND)
    return "\n".join(lines)


def _line(batch, path: str, cells: list[str], width: int) -> str:
    return " ".join([str(batch).rjust(5), path.ljust(width), *(c.rjust(_WIDTH) for c in cells)])


def plot(report: dict, path: str) -> None:
    """A 2x2 chart of the main figures against the batch size, one line per path, log scales."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    lines = [("reference", None, "reference")] + [("velocity", d, label) for d, (label, _) in
                                                   _labels(report["meta"]).items()]
    for ax, (key, title) in zip(axes.flat, CHART_PANELS, strict=True):
        for kind, dtype, label in lines:
            points = sorted((r["batch"], r[key]) for r in report["rows"]
                            if r["path"] == kind and (dtype is None or r.get("dtype") == dtype))
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set(title=title, xlabel="batch", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    meta = report["meta"]
    fig.suptitle(
        f"chattts-velocity bench: {meta['device']}, {meta['size']} model, {meta['tokens']} tokens, "
        f"engine {', '.join(meta.get('dtypes', [meta['dtype']]))}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""What the examples share: their model, device, output and length options, a ``Chat`` loaded from them, and
errors reported as the ``chattts-velocity`` command reports them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import chattts_velocity
from chattts_velocity.model.loader import ModelNotFoundError


def example_parser(doc: str, out: str,
                   max_new_help: str = "audio tokens per sentence at most") -> argparse.ArgumentParser:
    """A parser with ``--model``, ``--device``, ``--out`` (default ``out``) and ``--max-new-token``; the description
    is the first paragraph of the example's ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the Hugging Face weights)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--out", default=out, help=f"output folder (default: {out})")
    ap.add_argument("--max-new-token", type=int, default=2048, help=max_new_help)
    return ap


def load_chat(args: argparse.Namespace) -> chattts_velocity.Chat:
    """``--model``'s checkpoint folder, or the Hugging Face weights (downloaded once), on ``--device``."""
    chat = chattts_velocity.Chat()
    if args.model:
        chat.load(source="custom", custom_path=args.model, device=args.device)
    else:
        chat.load(source="huggingface", device=args.device)
    return chat


def run(main: Callable[[], None]) -> None:
    """``main()``, with a usage error (no weights where they were looked for, an unknown device, a bad setting)
    ending the script as it ends ``chattts-velocity``: one line on stderr, exit status 2, no traceback."""
    try:
        main()
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

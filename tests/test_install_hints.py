"""Every hint to install an extra works where the package is not on an index: it gives the clone's form
``pip install -e ".[extra]"`` beside ``"chattts-velocity[extra]"``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA = re.compile(r"chattts-velocity\[(\w+)\]")


def strings(path: Path) -> list[str]:
    """The string literals of a source file as Python reads them (implicit concatenations and f-strings joined)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            found.append("".join(v.value for v in node.values if isinstance(v, ast.Constant)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


def test_every_install_hint_names_the_clone_form():
    hints = []
    for folder in ("chattts_velocity", "webui", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for text in strings(path):
                for extra in EXTRA.findall(text):
                    hints.append((path.relative_to(ROOT), extra))
                    assert f'pip install -e ".[{extra}]"' in text, f"{path.relative_to(ROOT)}: {text!r}"
    assert {extra for _, extra in hints} >= {"server", "scale", "webui"}

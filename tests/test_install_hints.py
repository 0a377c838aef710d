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


def test_the_server_checks_its_packages_before_it_loads_a_model(monkeypatch, capsys, tmp_path):
    """A missing python-multipart (which FastAPI finds only when it builds the app, after the model loaded)
    stops ``serve`` at once, naming the package and the extra."""
    import importlib.util

    from chattts_velocity import cli

    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name in ("python_multipart", "multipart") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cli.missing_server_packages() == ["python-multipart"]
    code = cli.main(["serve", "--model", str(tmp_path / "no-such-checkpoint")])
    err = capsys.readouterr().err
    assert code == 2
    assert "python-multipart is not installed" in err and 'pip install -e ".[server]"' in err, err


def test_the_servers_package_check_covers_the_server_extra():
    import tomllib

    from chattts_velocity.cli import SERVER_MODULES

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    names = {re.split(r"[\[<>=]", dep)[0] for dep in extra}
    assert set(SERVER_MODULES) == names - {"av"}  # PyAV: only the compressed formats' encoders need it

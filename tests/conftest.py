from __future__ import annotations

import ast
import faulthandler
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
faulthandler.enable()  # before pytest's own, so a crash after the run (at the interpreter's exit) prints every thread

OPTIONAL = ("ray", "gradio", "gradio_client", "openai", "av", "livekit", "pipecat", "websockets", "playwright",
            "matplotlib", "multipart")
"""Packages of the optional extras: a test module that imports one that is not installed is not collected (a
GPU machine without the extras still runs ``pytest -m gpu tests/``), and the run's summary says which and why."""
NEEDS = {"chattts_velocity.webui": "gradio", "chattts_velocity.server.scale": "ray",
         "chattts_velocity.plugins.livekit": "livekit", "chattts_velocity.plugins.pipecat": "pipecat"}
"""The package's modules that import an optional package themselves."""
_LEFT_OUT: dict[str, list[str]] = {}


def _missing(path) -> list[str]:
    """The optional packages a test module imports at its top level that are not installed here."""
    tree = ast.parse(path.read_text())
    roots = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
            roots.update(need for module, need in NEEDS.items()
                         if node.module == module or node.module.startswith(module + ".")
                         or any(f"{node.module}.{alias.name}" == module for alias in node.names))
    return sorted(r for r in roots & set(OPTIONAL) if not _installed(r))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or shadowed install counts as missing
        return False


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        missing = _missing(collection_path)
        if missing:
            _LEFT_OUT[collection_path.name] = missing
            return True
    return None


def pytest_terminal_summary(terminalreporter):
    for name, missing in sorted(_LEFT_OUT.items()):
        terminalreporter.write_line(f"not collected: {name} (needs {', '.join(missing)}: pip install -e \".[dev]\")")


@pytest.fixture(scope="session")
def upstream_ckpt(tmp_path_factory):
    """A tiny random checkpoint written by upstream ChatTTS's own classes (seed 0)."""
    from upstream_checkpoint import write_upstream_checkpoint

    return write_upstream_checkpoint(str(tmp_path_factory.mktemp("upstream_ckpt")), seed=0)


@pytest.fixture(scope="session")
def upstream_chat(upstream_ckpt):
    from upstream_checkpoint import load_upstream

    return load_upstream(upstream_ckpt)


@pytest.fixture(scope="session")
def chat(upstream_ckpt):
    from chattts_velocity import Chat

    c = Chat()
    c.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    yield c
    c.unload()

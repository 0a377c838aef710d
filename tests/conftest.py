from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
    return c

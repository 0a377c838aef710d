"""Running a test module's cases under the Triton interpreter, in a subprocess: ``TRITON_INTERPRET=1`` must be
set before triton is first imported, which the pytest process has already done."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_PREFIX = "INTERPRETER_RESULTS "


def report(results: dict) -> None:
    """Called in the subprocess: hand ``results`` (JSON-able) back to the parent."""
    print(RESULT_PREFIX + json.dumps(results))


def run_interpreter_main(module: str) -> dict:
    """Run ``module.interpreter_main()`` (a module of tests/) with ``TRITON_INTERPRET=1``; its ``report``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, HERE, env.get("PYTHONPATH")) if p)
    code = f"import {module}; {module}.interpreter_main()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{output}"
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns its 1-element scalar arrays into loop bounds with int(), which
    numpy >= 2.4 refuses, so every dynamic-bound loop fails (triton-lang/triton#9171, fixed after 3.6)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched

"""Running Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess, so the setting does not leak into the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_in_interpreter(source: str) -> subprocess.CompletedProcess:
    """Run `source` (a script) in a subprocess under the interpreter, the interpreter index fix
    applied first, with src/ and tests/ in front of the caller's PYTHONPATH."""
    paths = [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    script = "from triton_interpreter import patch_interpreter_index\npatch_interpreter_index()\n"
    return subprocess.run(
        [sys.executable, "-c", script + source], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with `int(array)`, which
    NumPy >= 2.4 refuses for a 1-element array (triton-lang/triton#9171, fixed upstream); take the
    element instead. Call it inside the interpreter subprocess only."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index

"""Running Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess, so the setting does not leak into the test process)."""

from __future__ import annotations


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

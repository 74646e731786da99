"""Triton 3.6's interpreter (``TRITON_INTERPRET=1``, kernels on CPU tensors) with run-time loop bounds.

The interpreter turns a loop bound loaded inside a kernel (``range(start, end)`` with ``start`` a
loaded value, as the segment sum's pieces have) into a Python int with ``int()`` of a NumPy array of
shape (1,), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"). ``allow_runtime_loop_bounds`` gives the interpreter's tensors an ``__index__`` that takes
the element instead; it changes nothing outside the interpreter and is applied once."""

from __future__ import annotations


def allow_runtime_loop_bounds() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "runtime_loop_bounds", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.runtime_loop_bounds = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor

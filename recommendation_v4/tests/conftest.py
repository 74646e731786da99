"""Test-wide set-up. Without a GPU, Triton kernels run on CPU tensors through Triton's
interpreter; the variable must be set before triton is first imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton 3.6's interpreter turns loop bounds into ints with int(ndarray of shape (1,)), which
    # NumPy >= 2.4 rejects; take the element instead (kernel loops may have run-time bounds).
    from triton.runtime import interpreter

    if not getattr(interpreter._patch_lang_tensor, "numpy_index_fix", False):
        _original = interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _patch_lang_tensor.numpy_index_fix = True
        interpreter._patch_lang_tensor = _patch_lang_tensor

"""The Triton kernels. Under ``TRITON_INTERPRET=1`` the interpreter is made to accept the kernels'
run-time loop bounds before any kernel runs (``interpreter.py``)."""

from dlrmv4.ops.dispatch import interpreting

if interpreting():
    from dlrmv4.ops.triton.interpreter import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

"""Test-only start-up hook (on PYTHONPATH in tests/test_distributed.py): ``DLRMV4_TEST_OOM=rank:step``
makes that rank's training step raise torch's out-of-memory error at that step, as a GPU would."""

import os

_spec = os.environ.get("DLRMV4_TEST_OOM")
if _spec:
    _rank, _step = (int(part) for part in _spec.split(":"))
    if int(os.environ.get("RANK", "-1")) == _rank:
        import torch

        from dlrmv4.train import step as _step_module

        _original = _step_module.TrainStep.__call__

        def _failing(self, batch, index, *args, **kwargs):
            if index == _step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected by the test)")
            return _original(self, batch, index, *args, **kwargs)

        _step_module.TrainStep.__call__ = _failing

"""Test-only start-up hook (on PYTHONPATH in the multi-process tests): ``DLRMV4_TEST_OOM=rank:step``
makes that rank's training step run out of device memory at that step: on a GPU by allocating more
than the device holds (the allocator's own error), on the CPU by raising the error a GPU would."""

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
                if torch.cuda.is_available():
                    device = torch.cuda.current_device()
                    torch.empty(
                        2 * torch.cuda.get_device_properties(device).total_memory, dtype=torch.uint8, device=device
                    )
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected by the test)")
            return _original(self, batch, index, *args, **kwargs)

        _step_module.TrainStep.__call__ = _failing

"""Test-only start-up hook (on PYTHONPATH in the multi-process tests).

``DLRMV4_TEST_OOM=rank:step`` makes that rank's training step run out of device memory at that step:
on a GPU by allocating more than the device holds (the allocator's own error), on the CPU by raising
the error a GPU would. ``DLRMV4_TEST_REPORT_FAILS=1`` makes rank 0's report fail to write (after the
run's last collective). ``DLRMV4_TEST_COLLECTIVE_TEARDOWN=seconds`` makes ``destroy_process_group``
wait, as NCCL's teardown does, until every rank of the group has called it; a rank still waiting
after that many seconds exits 3 (where NCCL would wait for ever). ``DLRMV4_TEST_WATCH_DELAY=rank:seconds``
starts that rank's failure watch that much later (its polls fall later in each second than the
others'). ``DLRMV4_TEST_SLOW_RESUME_CHECK=seconds`` makes rank 0's check of the checkpoint to resume
from take that much longer (as hashing hundreds of GB does)."""

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

if os.environ.get("DLRMV4_TEST_REPORT_FAILS") and os.environ.get("RANK") == "0":
    from dlrmv4.train import run as _run_module

    def _report_fails(*args, **kwargs):
        raise OSError(28, "No space left on device (injected by the test)")

    _run_module.write_report = _report_fails

if os.environ.get("DLRMV4_TEST_COLLECTIVE_TEARDOWN"):
    import time

    import torch.distributed as _dist

    _destroy = _dist.destroy_process_group

    def _destroy_with_every_rank(group=None):
        world, deadline = _dist.get_world_size(), time.time() + float(os.environ["DLRMV4_TEST_COLLECTIVE_TEARDOWN"])
        store = _dist.distributed_c10d._get_default_store()
        joined = store.add("test/teardown", 1)
        while joined < world:
            if time.time() > deadline:
                os._exit(3)
            time.sleep(0.1)
            try:
                joined = store.add("test/teardown", 0)
            except Exception:  # noqa: BLE001 - the store went with rank 0: NCCL would go on waiting
                pass
        _destroy(group)

    _dist.destroy_process_group = _destroy_with_every_rank

_watch_delay = os.environ.get("DLRMV4_TEST_WATCH_DELAY")
if _watch_delay and os.environ.get("RANK") == _watch_delay.split(":")[0]:
    import time as _time

    from dlrmv4.distributed import liveness as _liveness

    _watch = _liveness.FailureWatch._watch

    def _late_watch(self):
        _time.sleep(float(_watch_delay.split(":")[1]))
        return _watch(self)

    _liveness.FailureWatch._watch = _late_watch

_slow_check = os.environ.get("DLRMV4_TEST_SLOW_RESUME_CHECK")
if _slow_check and os.environ.get("RANK") == "0":
    import time as _time

    from dlrmv4.train import run as _run_module

    _resume_point = _run_module.resume_point

    def _slow_resume_point(run_dir):
        _time.sleep(float(_slow_check))
        return _resume_point(run_dir)

    _run_module.resume_point = _slow_resume_point

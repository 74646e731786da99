"""The seam that picks the attention kernels (ops/attention_kernels.py) and its setting, on the CPU:
each choice on each target (a compile for a GPU this machine does not have picks what that GPU
runs), the refusals in one line, and the Gluon module importing without a GPU. The sm_90 compile of
the model's launches builds the Gluon forward: tests/test_kernel_targets.py."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.config import ModelConfig
from dlrmv4.ops import attention_kernels as seam
from dlrmv4.ops.compiled_kernels import _KERNEL_MODULES
from dlrmv4.ops.gluon import attention as hopper  # imports without a GPU
from dlrmv4.ops.triton.cross_compile import compiling_for
from dlrmv4.ops.triton.targets import target_named


@pytest.fixture(autouse=True)
def compiled_not_interpreted(monkeypatch):
    # The suite runs Triton's interpreter on the CPU; these choices are the compiled kernels'.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def qv(dtype=torch.bfloat16, dqk=128, dv=128):
    return torch.empty(0, 4, dqk, dtype=dtype), torch.empty(0, 4, dv, dtype=dtype)


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "gfx942", "gfx950"])
def test_auto_picks_gluon_on_hopper_only(target):
    with compiling_for(target_named(target)):
        kernels = seam.attention_kernels("auto", *qv())
    assert (kernels.forward, kernels.backward) == (("gluon" if target == "sm_90" else "triton"), "triton")
    assert kernels.describe() == f"attention kernels: forward {kernels.forward}, backward triton"


@pytest.mark.parametrize(
    "dtype,dqk,dv,why",
    [
        (torch.float32, 128, 128, "bf16 or fp16, not float32"),
        (torch.bfloat16, 32, 32, "head dims of 64 or 128, not 32/32"),
        (torch.float16, 128, 256, "head dims of 64 or 128, not 128/256"),
    ],
)
def test_auto_falls_back_and_gluon_is_refused_where_it_does_not_apply(dtype, dqk, dv, why):
    with compiling_for(target_named("sm_90")):
        assert seam.attention_kernels("auto", *qv(dtype, dqk, dv)).forward == "triton"
        with pytest.raises(
            ValueError, match=f"^attention_kernels=gluon: the Gluon attention cannot run here: .*{why}$"
        ):
            seam.attention_kernels("gluon", *qv(dtype, dqk, dv))


def test_gluon_runs_both_gluon_kernels_and_auto_the_faster_pair():
    with compiling_for(target_named("sm_90")):
        forced, auto = seam.attention_kernels("gluon", *qv()), seam.attention_kernels("auto", *qv())
    assert (forced.fwd, forced.bwd) == (hopper.attention_fwd, hopper.attention_bwd)
    assert (auto.fwd, auto.backward) == (hopper.attention_fwd, "triton")
    assert forced.describe() == "attention kernels: forward gluon, backward gluon"


def test_gluon_is_refused_off_hopper_and_triton_is_taken_anywhere():
    with compiling_for(target_named("sm_100")):
        with pytest.raises(ValueError, match="built for sm_90 .*not sm_100"):
            seam.attention_kernels("gluon", *qv())
    with compiling_for(target_named("sm_90")):
        assert seam.attention_kernels("triton", *qv()).forward == "triton"
    with pytest.raises(ValueError, match="attention_kernels='cudnn' is not one of auto, gluon, triton"):
        seam.attention_kernels("cudnn", *qv())


def test_the_interpreter_runs_the_portable_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert seam.attention_kernels("auto", *qv()).forward == "triton"
    with pytest.raises(ValueError, match="the Triton interpreter runs no Gluon kernels"):
        seam.attention_kernels("gluon", *qv())


def test_the_setting_and_the_kernel_count_see_gluon():
    field = ModelConfig.__dataclass_fields__["attention_kernels"]
    assert field.default == "auto" and field.metadata["choices"] == seam.ATTENTION_KERNEL_CHOICES
    assert "dlrmv4.ops.gluon." in _KERNEL_MODULES
    assert hopper.attention_fwd.__module__ == "dlrmv4.ops.gluon.attention"

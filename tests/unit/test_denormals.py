"""``call_flushing_denormals``: a call with denormal floats flushed to zero on this thread, and the
caller's floating-point mode afterwards as it was (compiled partitions run through it)."""

from __future__ import annotations

import pytest
import torch

from qplug_core.plugin_api import call_flushing_denormals, denormals_flushed

DENORMAL = torch.tensor([1e-39])  # below float32's normal range (1.18e-38)


def _halved() -> tuple[bool, float]:
    return denormals_flushed(), float(DENORMAL * 0.5)


def test_the_call_computes_denormals_as_zero_and_the_mode_is_restored():
    assert not denormals_flushed() and _halved() == (False, pytest.approx(5e-40, rel=1e-3))
    assert call_flushing_denormals(_halved) == (True, 0.0)
    assert _halved()[1] == pytest.approx(5e-40, rel=1e-3)


def test_the_mode_is_restored_when_the_call_raises():
    def fails():
        assert denormals_flushed()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        call_flushing_denormals(fails)
    assert not denormals_flushed()


def test_a_thread_that_already_flushes_keeps_flushing():
    torch.set_flush_denormal(True)
    try:
        assert call_flushing_denormals(_halved) == (True, 0.0)
        assert denormals_flushed()
    finally:
        torch.set_flush_denormal(False)
    assert not denormals_flushed()

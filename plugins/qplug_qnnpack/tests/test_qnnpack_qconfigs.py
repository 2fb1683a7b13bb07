"""qconfigs ported from torch.ao's fbgemm-era code on qnnpack (mobile report, 5): 7-bit activations
(``reduce_range=True``) cost ~3.5 dB and qnnpack does not need them, which went unsaid; the migration
guide's ``default_qconfig`` was refused for its ``eps`` and weight range without saying what to set."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp

MinMaxObserver, PerChannelMinMaxObserver = qp.observers.MinMaxObserver, qp.observers.PerChannelMinMaxObserver
SEVEN_BITS = "get 7 bits, quint8 [0, 127] (reduce_range=True"
E = 2 ** -12


def _prepare(qconfig: qp.QConfig | None, backend: str = "qnnpack", **kw) -> list[str]:
    """What prepare_fx of a small CNN under ``qconfig`` (None: the backend's defaults) warns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    mapping = None if qconfig is None else qp.QConfigMapping().set_global(qconfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qp.prepare_fx(model, mapping, (torch.randn(1, 3, 8, 8),), backend=backend, **kw)
    return [str(w.message) for w in caught]


def _weight(**kw):
    return PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, **kw)


def test_seven_bit_activations_on_qnnpack_warn_and_say_what_to_do(qplug_only):
    qplug_only("qplug-qnnpack")
    said = [m for m in _prepare(qp.QConfig(activation=MinMaxObserver.with_args(reduce_range=True, eps=E),
                                           weight=_weight(quant_min=-127, quant_max=127, eps=E))) if SEVEN_BITS in m]
    assert len(said) == 1
    assert "accumulate in int32" in said[0] and "Drop reduce_range=True from the activation observer" in said[0]


def test_the_default_qconfigs_and_fbgemm_s_seven_bits_say_nothing_of_it(qplug_only):
    """fbgemm's kernels sum pairs in int16 without VNNI: reduce_range is a real choice there."""
    qplug_only("qplug-qnnpack", "qplug-fbgemm")
    assert not [m for m in _prepare(None) if SEVEN_BITS in m]
    fbgemm_style = qp.QConfig(activation=MinMaxObserver.with_args(reduce_range=True), weight=_weight())
    assert not [m for m in _prepare(fbgemm_style, "fbgemm") if SEVEN_BITS in m]


def test_the_migration_guide_s_default_qconfig_is_refused_naming_the_values_to_set(qplug_only):
    qplug_only("qplug-qnnpack")
    default_qconfig = qp.QConfig(
        activation=MinMaxObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
    with pytest.raises(qp.errors.ConstraintViolationError) as refused:
        _prepare(default_qconfig, on_unsupported="raise")
    assert "below the backend's minimum scale 0.000244140625: give the observer eps=2**-12" in str(refused.value)
    assert ("quant range (-128, 127) must fall within the backend's (-127, 127): give the observer "
            "quant_min=-127, quant_max=127") in str(refused.value)

"""The qplug_weight_only_kernels hook: a third-party backend adds a weight-only kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.weight_only.selection import available_kernels

VENDOR = '''
import torch
from qplug_core.plugin_api import BackendSpec, WeightOnlyKernel, hookimpl


class Float64Kernel(WeightOnlyKernel):
    """Dequantizes once at pack time and multiplies in float64 (a stand-in for a vendor library)."""

    name = "vendor-float64"

    def supports(self, scheme, shape, activation_dtype):
        return None if scheme.bits == 4 else "int4 only"

    def pack(self, weight):
        return weight.dequantize(torch.float64)

    def run(self, packed, x, bias):
        y = (x.double() @ packed.T).to(x.dtype)
        return y if bias is None else y + bias


class Broken(WeightOnlyKernel):
    name = "vendor-broken"

    def supports(self, scheme, shape, activation_dtype):
        return None

    def pack(self, weight):
        raise RuntimeError("the vendor library is not initialised")


@hookimpl
def qplug_register_backends():
    return [BackendSpec("vendor", "a weight-only vendor backend")]


@hookimpl
def qplug_weight_only_kernels(backend):
    return [Float64Kernel(), Broken()] if backend == "vendor" else []
'''


def test_hook_qplug_weight_only_kernels(fake_dist):
    fake_dist("qplug-vendor", VENDOR)
    names = [k.name for k in available_kernels("vendor")]
    assert names[-2:] == ["vendor-float64", "vendor-broken"] and "reference" in names
    assert "vendor-float64" in [k.name for k in available_kernels()]  # every installed backend
    model = nn.Sequential(nn.Linear(64, 32))
    qmodel = qp.quantize_weights(model, bits=4, group_size=32, backend="vendor", kernel="vendor-float64")
    assert qmodel.qplug_weight_only.kernels == {"0": "vendor-float64"}
    reference = qp.quantize_weights(model, bits=4, group_size=32, kernel="reference")
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), reference(x), rtol=1e-5, atol=1e-5)
    measured = qp.quantize_weights(model, bits=4, group_size=32, backend="vendor")
    choice = measured.qplug_weight_only.choices[0]
    assert "not initialised" in choice.rejected["vendor-broken"]
    # float64 is twice the float weight: correct, but the "smaller" model would not be
    assert "no fewer than the float weight's 8,192" in choice.rejected["vendor-float64"]


def test_an_unknown_backend_is_named(fake_dist):
    fake_dist("qplug-vendor", VENDOR)
    with pytest.raises(qp.errors.BackendNotFoundError, match="did you mean 'vendor'"):
        qp.quantize_weights(nn.Sequential(nn.Linear(8, 8)), backend="vendro")

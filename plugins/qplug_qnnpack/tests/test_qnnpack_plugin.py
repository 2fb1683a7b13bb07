"""The installed qplug-qnnpack distribution is discovered through its entry point and assembled."""

from __future__ import annotations

import pytest
import torch

import qplug_core as qp


def test_backend_is_listed_with_real_availability(qplug_only):
    qplug_only("qplug-qnnpack")
    info = next(i for i in qp.list_backends() if i.name == "qnnpack")
    assert [(r.dist, r.name) for r in info.contributors] == [("qplug-qnnpack", "qnnpack")]
    assert info.available is ("qnnpack" in torch.backends.quantized.supported_engines)
    assert info.n_pattern_configs == 255  # 249 + a @ b, a.matmul(b), torch.bmm, a.bmm(b), torch.mm, a.mm(b)


def test_weights_stay_in_the_kernels_symmetric_range(qplug_only):
    qplug_only("qplug-qnnpack")
    weight = qp.get_default_qconfig_mapping("qnnpack").global_qconfig.weight()
    assert (weight.quant_min, weight.quant_max) == (-127, 127)


def test_misspelled_name_suggests_qnnpack(qplug_only):
    qplug_only()
    with pytest.raises(qp.errors.BackendNotFoundError, match="did you mean 'qnnpack'"):
        qp.get_backend("qnnpak")


def test_with_only_qnnpack_loaded_fbgemm_is_named_with_its_distribution(qplug_only):
    qplug_only("qnnpack")
    assert sorted(i.name for i in qp.list_backends()) == ["qnnpack", "reference"]
    with pytest.raises(qp.errors.BackendNotFoundError, match="qplug-fbgemm .* provides 'fbgemm' but is not loaded"):
        qp.get_backend("fbgemm")

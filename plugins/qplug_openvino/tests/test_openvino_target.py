"""An accuracy target on openvino: a layer taken out of static int8 goes to the plugin's dynamic
linear (int8 weights, its input quantized by OpenVINO at run time), then float; no per-token rung
(partitions are compiled from the reference form), and ``qp.quantize`` with a target — the
default for transformers — runs on either CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags

VNNI = "avx2 avx512f avx512bw avx512_vnni"
AVX2 = "fpu sse2 avx avx2 fma"


@pytest.mark.parametrize("flags", [VNNI, AVX2])
def test_the_ladder_on_openvino_is_dynamic_then_float(flags):
    with override_cpu_flags(flags):
        assert qp.Target(cosine=0.99).ladder(qp.get_backend("openvino")) == ("dynamic", "float")
        assert qp.Target(cosine=0.99).ladder(qp.get_backend("fbgemm"))[-2:] == ("dynamic", "float")


@pytest.mark.parametrize("flags", [VNNI, AVX2])
def test_a_target_on_openvino_takes_the_worst_layer_out_of_static_int8(flags):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():  # one GELU channel 30x the rest: the last linear's per-tensor input grid loses the others
        model[0].weight[0] *= 30.0
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g),) for _ in range(4)]
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "accuracy target not met")
        qmodel = qp.quantize(model, data[0], data, backend="openvino",
                             target=qp.Target(cosine=0.999, group="layer"))
    result = qmodel.meta["qplug_target"]
    (decision,) = result.decisions  # the first rung whose local error pays (float, measured here)
    assert decision.layers == ("2",) and decision.fallback in ("dynamic", "float")
    report = qp.quantization_report(qmodel)
    assert not report.outside and not report.reference
    held_out = torch.randn(32, 16, generator=g)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(model(held_out), qmodel(held_out), dim=1)
    assert float(cosine.mean()) > 0.998 and float(cosine.min()) > 0.98

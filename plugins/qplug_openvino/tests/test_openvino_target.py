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
def test_a_target_on_openvino_takes_the_worst_layer_to_its_dynamic_linear(flags):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():  # one output channel 1000x the rest: per-tensor static int8 crushes the others
        model[2].weight[0] *= 1000.0
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g),) for _ in range(4)]
    # whether the batch score then meets 0.999 depends on the CPU's weight grid; not asserted
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "accuracy target not met")
        qmodel = qp.quantize(model, data[0], data, backend="openvino",
                             target=qp.Target(cosine=0.999, group="layer"))
    result = qmodel.meta["qplug_target"]
    # the crushed layer first; whether the first layer follows depends on the CPU's weight grid
    assert result.decisions[0].layers == ("2",) and {d.fallback for d in result.decisions} == {"dynamic"}
    report = qp.quantization_report(qmodel)
    assert not report.outside and not report.reference  # it runs inside the OpenVINO model
    held_out = torch.randn(32, 16, generator=g)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(model(held_out), qmodel(held_out), dim=1)
    assert float(cosine.mean()) > 0.9995 and float(cosine.min()) > 0.99  # the crushed layer's output is float

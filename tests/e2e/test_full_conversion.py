"""Issue 7: ResNet-18 and MobileNetV2 convert *fully* on fbgemm and qnnpack.

Full conversion means: every compute op between the model's first quantize and its last
dequantize runs on a backend kernel (nothing is left in reference form or in float), and
consecutive int8 ops hand each other quantized tensors (no dequantize -> quantize pair anywhere).
Inputs are 112x112 to keep the test short; MobileNetV2 gets data-driven BatchNorm statistics first.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import qplug_core as qp
from qplug_core.flows.report import _NON_COMPUTE_FUNCTIONS, describe_op, report_names
from qplug_core.flows.tags import BOUNDARY, KERNEL
from qplug_core.zoo import calibrate_batchnorm, get_model

#: ops that may stay in reference form / float, per (model, backend): none, both backends have a
#: kernel for every op of these two models
EXPECTED_REFERENCE: dict[tuple[str, str], set[str]] = {}
EXPECTED_SKIPPED: dict[tuple[str, str], set[str]] = {}
#: lowered vs reference on an input not used for calibration (measured here: ResNet-18 35-41 dB,
#: MobileNetV2 16.4-16.6 dB; MobileNetV2's gap is far larger than ResNet's and still unexplained)
MIN_SQNR_VS_REFERENCE = {"resnet18": 25.0, "mobilenet_v2": 10.0}


def _batches(n: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 3, 112, 112, generator=gen),) for _ in range(n)]


def _model(name: str) -> torch.nn.Module:
    model = get_model(name, seed=0, num_classes=10)
    if name == "mobilenet_v2":
        calibrate_batchnorm(model, [(torch.randn(4, 3, 112, 112, generator=torch.Generator()
                                                 .manual_seed(1)),)])
    return model


def _boundary_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    if node.op != "call_module" or BOUNDARY not in node.meta:
        return None
    return "dequantize" if "Dequantize" in type(gm.get_submodule(node.target)).__name__ else "quantize"


def _float_ops_inside(gm: fx.GraphModule, kernels: dict[str, str]) -> list[str]:
    """Compute ops between the first quantize and the last dequantize that run no kernel.

    Kernel modules carry ``KERNEL`` in their meta; passthrough ops (pooling, flatten) keep their
    node and run on the quantized tensor, and are listed in the report's kernels by anchor name.
    """
    nodes = list(gm.graph.nodes)
    kinds = [_boundary_kind(gm, n) for n in nodes]
    first = kinds.index("quantize")
    last = len(kinds) - 1 - kinds[::-1].index("dequantize")
    found = []
    report_key = report_names(gm.graph)
    for node, kind in zip(nodes[first + 1:last], kinds[first + 1:last]):
        if node.op not in ("call_module", "call_function", "call_method") or kind or KERNEL in node.meta \
                or report_key(node) in kernels:
            continue
        if describe_op(node, gm) not in _NON_COMPUTE_FUNCTIONS:
            found.append(f"{node.name} ({describe_op(node, gm)})")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("model_name", ["resnet18", "mobilenet_v2"])
def test_converts_fully(plugin_autoload, one_thread, model_name, backend):
    chosen = qp.get_backend(backend)
    if not chosen.availability().ok:
        pytest.skip(chosen.availability().reason)
    model = _model(model_name)
    calibration, test_input = _batches(2)[:1], _batches(2)[1]
    observed = qp.prepare_fx(model, None, calibration[0], backend=chosen)
    qp.calibrate(observed, calibration, progress=False)
    lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)

    assert report.kernels, "nothing was lowered"
    assert set(report.reference) == EXPECTED_REFERENCE.get((model_name, backend), set()), report.reference
    assert {s.node for s in report.skipped} == EXPECTED_SKIPPED.get((model_name, backend), set()), \
        report.skipped
    assert _float_ops_inside(lowered, report.kernels) == []

    kinds = [(n, _boundary_kind(lowered, n)) for n in lowered.graph.nodes]
    quantizes = [n for n, k in kinds if k == "quantize"]
    dequantizes = [n for n, k in kinds if k == "dequantize"]
    # one quantize of the image, one dequantize of the logits: int8 from end to end
    assert [n.args[0].op for n in quantizes] == ["placeholder"]
    assert len(dequantizes) == 1 and [u.op for u in dequantizes[0].users] == ["output"]
    assert not [n for n in quantizes if _boundary_kind(lowered, n.args[0]) == "dequantize"]

    reference = qp.convert_to_reference_fx(observed)
    with torch.no_grad():
        expected, got = reference(*test_input), lowered(*test_input)
    assert qp.sqnr(expected, got) >= MIN_SQNR_VS_REFERENCE[model_name]

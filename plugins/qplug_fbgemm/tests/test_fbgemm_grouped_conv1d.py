"""Depthwise and small-group Conv1d run on torch's oneDNN engine, exactly as the reference form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import KernelContext, QParams, override_cpu_flags

from qplug_fbgemm.plugin import plugin as fbgemm_plugin

pytestmark = pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines,
                                reason="torch without the onednn engine")
VNNI, AVX2 = "avx2 avx512f avx512bw avx512_vnni", "avx2 fma"


def _qparams(scale: float, zero_point: int, quant_max: int) -> QParams:
    return QParams(torch.tensor(scale), torch.tensor(zero_point), torch.quint8, 0, quant_max)


def _kernel_and_reference(conv: nn.Conv1d, input_max: int, weight_max: int):
    """The fbgemm plugin's kernel for ``conv`` and its output and the reference form's, in integers."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * 0.3)
    scale = conv.weight.detach().abs().amax(dim=(1, 2)) / weight_max
    wqp = QParams(scale, torch.zeros(conv.out_channels, dtype=torch.long), torch.qint8,
                  -weight_max - 1 if weight_max == 127 else -weight_max, weight_max, axis=0)
    x_int = torch.randint(0, input_max + 1, (2, conv.in_channels, 30), generator=gen)
    x = torch._make_per_tensor_quantized_tensor(x_int.to(torch.uint8), 0.02, 9)
    weight = torch.quantize_per_channel(conv.weight.detach(), scale, wqp.zero_point, 0, torch.qint8)
    expected = F.conv1d(x.dequantize(), weight.dequantize(), conv.bias.detach(), padding=conv.padding,
                        groups=conv.groups)
    out_scale = float(expected.abs().max()) / 120
    ctx = KernelContext(pattern=nn.Conv1d, module=conv, target=None, input_qparams=(_qparams(0.02, 9, input_max),),
                        output_qparams=_qparams(out_scale, 128, 255), weight_qparams=wqp, engine="fbgemm")
    kernel = fbgemm_plugin.kernels()[nn.Conv1d].build(ctx)
    reference = torch.quantize_per_tensor(expected, out_scale, 128, torch.quint8).int_repr().int()
    return kernel, kernel(x).int_repr().int(), reference


@pytest.mark.parametrize("flags", [VNNI, AVX2])
def test_depthwise_conv1d_runs_on_onednn_and_equals_the_reference_form(flags):
    """fbgemm's generic grouped path ran a depthwise Conv1d 5-80x slower than float; oneDNN sums in
    int32 on every CPU, so with fbgemm's 7-bit depthwise inputs it is exact."""
    with override_cpu_flags(flags):
        kernel, out, reference = _kernel_and_reference(nn.Conv1d(16, 16, 5, padding=2, groups=16), 127, 127)
    assert kernel.engine == "onednn"
    assert torch.equal(out, reference)


@pytest.mark.parametrize("flags, engine", [(VNNI, "onednn"), (AVX2, "fbgemm")])
def test_a_grouped_conv1d_whose_pairs_can_leave_int16_keeps_fbgemm_without_vnni(flags, engine):
    """oneDNN's grouped kernel sums u8 x s8 pairs in int16 without VNNI: 8-bit inputs and weights
    (2 * 255 * 127 > 32,767) stay on fbgemm's kernel there (a decision, taken as that CPU would)."""
    with override_cpu_flags(flags):
        kernel, _, _ = _kernel_and_reference(nn.Conv1d(16, 16, 3, padding=1, groups=4), 255, 127)
    assert kernel.engine == engine


def test_a_grouped_conv1d_with_pairs_inside_int16_equals_the_reference_form_on_this_cpu():
    """The kernels for real, with this host's arithmetic and 7-bit inputs (2 * 127 * 127 < 32,767):
    no engine saturates, with or without VNNI."""
    _, out, reference = _kernel_and_reference(nn.Conv1d(16, 16, 3, padding=1, groups=4), 127, 127)
    assert (out - reference).abs().max() <= 1


def test_dense_and_wide_group_conv1d_keep_fbgemm():
    for conv in (nn.Conv1d(16, 16, 3, padding=1), nn.Conv1d(64, 64, 3, padding=1, groups=2)):
        kernel, _, _ = _kernel_and_reference(conv, 127, 127)
        assert kernel.engine == "fbgemm"


def test_a_conformer_conv_module_is_int8_on_onednn_through_qp_quantize(qplug_only):
    qplug_only("qplug-fbgemm")
    model = nn.Sequential(nn.Conv1d(8, 16, 1), nn.Conv1d(16, 16, 7, padding=3, groups=16),
                          nn.BatchNorm1d(16), nn.ReLU(), nn.Conv1d(16, 8, 1)).eval()
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 8, 40, generator=gen),) for _ in range(4)]
    quantized = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
    engines = {name: m.engine for name, m in quantized.named_modules() if hasattr(m, "engine")}
    assert "onednn" in engines.values() and "fbgemm" in engines.values()
    x = torch.randn(1, 8, 40, generator=gen)
    assert F.cosine_similarity(model(x).flatten(), quantized(x).flatten(), dim=0) > 0.999

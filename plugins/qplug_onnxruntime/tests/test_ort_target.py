"""An accuracy target on onnxruntime: what the search decides is what the ORT session runs.

The per-token rung is swapped in after convert and a compiled partition runs the reference form it
was compiled from, so on this backend the ladder has no per-token rung (with or without VNNI): a
layer taken out of static int8 runs as ORT's dynamic int8 matmul, or float, inside the session.
A linear whose output no int8 op reads keeps it float (ORT's MatMulIntegerToFloat), so an outlier
output channel there costs nothing and needs no fallback.
"""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import (
    PAIRS_SATURATE,
    ConfigValidationError,
    override_cpu_flags,
    probe_pair_sums,
    whole_model,
)

from qplug_onnxruntime.session import OrtPartition

VNNI = "avx2 avx512f avx512bw avx512_vnni"
AVX2 = "fpu sse2 avx avx2 fma"


def on_kernels_like(flags: str) -> None:
    """Skip where ``flags`` name VNNI but this host's ORT kernels saturate int16 pair sums: a VNNI
    CPU's 8-bit decisions there break the kernel contract and convert keeps the reference form
    (``tests/reliability/test_emulated_cpu_without_vnni.py``), so a test of the sessions such
    decisions build has nothing to run."""
    from qplug_onnxruntime.probe import matmul_integer

    if flags == VNNI and probe_pair_sums(matmul_integer) == PAIRS_SATURATE:
        pytest.skip("VNNI decisions need ORT kernels that accumulate in int32; this host's saturate")


class ScaledBack(nn.Module):
    """``body(x) * back``: a per-channel rescale of the output after the last linear."""

    def __init__(self, body: nn.Module, back: torch.Tensor) -> None:
        super().__init__()
        self.body = body
        self.register_buffer("back", back)

    def forward(self, x):
        return self.body(x) * self.back


def outlier_output() -> nn.Module:
    """The last linear (after a GELU, which stays float) has an output channel 1000x the rest,
    scaled back after it: a calibrated per-tensor output scale crushes the other channels; a
    dynamic int8 linear (float output) does not."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    with torch.no_grad():
        body[2].weight[0] *= 1000.0
        body[2].bias[0] *= 1000.0
    return ScaledBack(body, torch.cat([torch.full((1,), 1e-3), torch.ones(7)])).eval()


@pytest.mark.parametrize("flags", [VNNI, AVX2])
def test_a_compiling_backend_has_no_per_token_rung(flags):
    with override_cpu_flags(flags):
        assert qp.Target(cosine=0.99).ladder(qp.get_backend("onnxruntime")) == ("dynamic", "float")
        with pytest.raises(ConfigValidationError, match=r"fallback='per_token'\) cannot run on backend 'onnxruntime'"):
            qp.Target(cosine=0.99, fallback="per_token").ladder(qp.get_backend("onnxruntime"))


def _session_ops(qmodel) -> collections.Counter:
    (partition,) = [m for m in qmodel.modules() if isinstance(m, OrtPartition)]
    return collections.Counter(n.op_type for n in onnx.load_from_string(whole_model(partition.sources[0])).graph.node)


def _held_out_cosine(model, qmodel, x) -> torch.Tensor:
    with torch.no_grad():
        return torch.nn.functional.cosine_similarity(model(x), qmodel(x), dim=1)


@pytest.mark.parametrize("flags", [VNNI, AVX2])
def test_an_outlier_output_no_int8_op_reads_stays_static_int8(flags):
    # the last linear's output goes to a float op alone: it stays float, so the calibrated
    # per-tensor grid that would crush the other channels (cosine < 0.99) never exists
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g),) for _ in range(4)]
    held_out = torch.randn(32, 16, generator=g)
    on_kernels_like(flags)
    model = outlier_output()
    with override_cpu_flags(flags):
        qmodel = qp.quantize(model, data[0], data, backend="onnxruntime",
                             target=qp.Target(cosine=0.999, group="layer"))
    result = qmodel.meta["qplug_target"]
    assert result.met and result.decisions == [] and result.all_int8.cosine_mean > 0.999
    ops = _session_ops(qmodel)
    assert ops["MatMulInteger"] == 0 and ops["Gemm"] == 2 and ops["QuantizeLinear"] == 2  # both static
    cosine = _held_out_cosine(model, qmodel, held_out)
    assert float(cosine.mean()) > 0.998 and float(cosine.min()) > 0.98  # held out: near the target


@pytest.mark.parametrize(("flags", "fallbacks"), [(VNNI, ["dynamic", "dynamic"]), (AVX2, ["dynamic", "float"])],
                         ids=["vnni", "avx2"])
def test_the_layer_taken_out_runs_dynamic_int8_inside_the_session(flags, fallbacks):
    # batches 300x apart in scale: one calibrated grid crushes the small ones, ORT's run-time
    # quantization (DynamicQuantizeLinear) fits each batch. Every layer is taken out, so each
    # takes a fallback no worse than its own static int8 or the median layer: with AVX2's 7-bit
    # weights the last linear's dynamic error is above both, so it goes float
    on_kernels_like(flags)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g) * scale,) for scale in (1, 300, 1, 300)]
    held_out = torch.randn(32, 16, generator=g)
    with override_cpu_flags(flags):
        qmodel = qp.quantize(model, data[0], data, backend="onnxruntime",
                             target=qp.Target(cosine=0.995, group="layer"))
    result = qmodel.meta["qplug_target"]
    assert result.met and result.float_layers == ["0", "2"]
    assert [d.fallback for d in result.decisions] == fallbacks
    ops = _session_ops(qmodel)
    dynamic = fallbacks.count("dynamic")  # inside ORT
    assert ops["MatMulInteger"] == dynamic and ops["DynamicQuantizeLinear"] == dynamic
    assert result.all_int8.cosine_mean < 0.9  # all static int8 misses it by far
    cosine = _held_out_cosine(model, qmodel, held_out)
    assert float(cosine.mean()) > 0.995 and float(cosine.min()) > 0.98

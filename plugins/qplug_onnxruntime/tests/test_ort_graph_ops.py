"""Graph ops of GNN readouts and detection post-processing, exported by qplug and run in ONNX
Runtime: segment mean pooling (``scatter_reduce(reduce="mean")``) and ``gather`` with an index
smaller than its input."""

from __future__ import annotations

import copy
import warnings

import onnxruntime as ort
import pytest
import torch
from ort_testkit import output_step, within_one_step
from torch import fx

import qplug_core as qp
from qplug_core.plugin_api import to_onnx_proto


class ScatterMean(torch.nn.Module):
    def __init__(self, dim: int, include_self: bool) -> None:
        super().__init__()
        self.dim, self.include_self = dim, include_self

    def forward(self, base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return base.scatter_reduce(self.dim, index, src, reduce="mean", include_self=self.include_self)


def _in_onnxruntime(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    proto = to_onnx_proto(fx.symbolic_trace(module), args)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    return torch.from_numpy(session.run(None, feeds)[0])


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize(("dim", "base", "index", "src"), [
    (0, (5, 6), (7, 6), (7, 6)),  # segment pooling: 7 rows into 5 segments
    (0, (5, 6), (7, 4), (9, 8)),  # the index smaller than base and src: torch reads only its extent
    (1, (3, 8), (2, 11), (3, 12)),
    (0, (4,), (10,), (10,)),
])
def test_scatter_mean_matches_torch(dim, base, index, src, include_self):
    """torch.onnx wrote a plain ScatterElements (ORT: 0.5255 where torch says 0.5001)."""
    torch.manual_seed(0)
    targets = base[dim] - 2  # the last two targets get nothing: they keep ``base``
    args = (torch.randn(base), torch.randint(0, targets, index), torch.randn(src))
    got = _in_onnxruntime(ScatterMean(dim, include_self), args)
    torch.testing.assert_close(got, ScatterMean(dim, include_self)(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("args", [
    # (-3 - 4 + 2) / 3 -> -2 and (5 - 3 - 4 + 2) / 4 -> 0: floor division, as torch's
    (torch.full((3,), 5), torch.tensor([0, 0, 1, 0]), torch.tensor([-3, -4, -7, 2])),
    (torch.tensor(2.0), torch.tensor(0), torch.tensor(5.0)),  # scalars
], ids=["int64", "scalar"])
def test_integer_and_scalar_scatter_mean_match_torch(args, include_self):
    assert torch.equal(_in_onnxruntime(ScatterMean(0, include_self), args), ScatterMean(0, include_self)(*args))


class TopBoxes(torch.nn.Module):
    def forward(self, p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return p.gather(1, index)


@pytest.mark.parametrize("index", [(2, 5, 4), (2, 5, 9), (1, 30, 2)])
def test_gather_with_a_smaller_index_matches_torch(index):
    """ONNX Runtime took torchlib's GatherElements; qplug's cuts the input first (for OpenVINO)."""
    args = (torch.randn(2, 30, 9), torch.randint(0, 30, index))
    assert torch.equal(_in_onnxruntime(TopBoxes(), args), TopBoxes()(*args))


class SegmentMeanPool(torch.nn.Module):
    """Linear, mean of each graph's node rows (``batch`` says which graph), Linear."""

    def __init__(self, include_self: bool) -> None:
        super().__init__()
        self.a, self.b, self.include_self = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), include_self

    def forward(self, x: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        pooled = torch.zeros(3, 8).scatter_reduce(0, batch.unsqueeze(-1).expand_as(h), h, reduce="mean",
                                                  include_self=self.include_self)
        return self.b(pooled)


def graphs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = torch.cat([torch.arange(3), torch.randint(0, 3, (17,), generator=generator)]).sort().values
    return torch.randn(20, 8, generator=generator), batch


@pytest.mark.parametrize("include_self", [False, True])
def test_segment_mean_pooling_runs_its_linears_in_onnxruntime(include_self):
    """Both linears ran in reference form: the partition broke the kernel contract (0% of its
    outputs within one step of the reference)."""
    torch.manual_seed(0)
    calibration = [graphs(seed) for seed in range(4)]
    observed = qp.calibrate(qp.prepare_fx(SegmentMeanPool(include_self).eval(), None, calibration[0],
                                          backend="onnxruntime"), calibration)
    reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no contract fallback, no compile failure
        ort_model = qp.convert_fx(observed)
    assert qp.quantization_report(ort_model).kernels == {"a": "delegate:delegate_0", "b": "delegate:delegate_0"}
    held_out = [graphs(seed) for seed in range(10, 14)]
    with torch.no_grad():
        expected = torch.cat([reference(*g) for g in held_out])
        assert within_one_step(expected, torch.cat([ort_model(*g) for g in held_out]), output_step(reference)) == 1

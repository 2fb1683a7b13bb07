"""Graph ops of GNNs and detection heads in OpenVINO partitions: segment mean pooling
(``scatter_reduce(reduce="mean")``), top-k box ``gather`` with an index smaller than its input,
and ``torch.sparse.mm`` over an ``edge_index`` under ``capture="export"``."""

from __future__ import annotations

import copy
import functools
import warnings

import openvino
import pytest
import torch
from ov_testkit import output_step
from torch import fx

import qplug_core as qp
from qplug_core.plugin_api import to_onnx_proto


def _in_openvino(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    core = openvino.Core()
    source = to_onnx_proto(fx.symbolic_trace(module), args).SerializeToString()
    compiled = core.compile_model(core.read_model(source), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return torch.from_numpy(compiled([a.numpy() for a in args])[0].copy())


class ScatterMean(torch.nn.Module):
    def __init__(self, include_self: bool) -> None:
        super().__init__()
        self.include_self = include_self

    def forward(self, base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return base.scatter_reduce(0, index, src, reduce="mean", include_self=self.include_self)


@pytest.mark.parametrize("include_self", [False, True])
def test_scatter_mean_matches_torch(include_self):
    """OpenVINO computed the torch.onnx translation (no division): 4% of a pooled output within
    one step of the reference."""
    torch.manual_seed(0)
    args = (torch.randn(5, 6), torch.randint(0, 3, (7, 4)), torch.randn(9, 8))  # targets 3, 4 get nothing
    got = _in_openvino(ScatterMean(include_self), args)
    torch.testing.assert_close(got, ScatterMean(include_self)(*args), rtol=1e-6, atol=1e-6)


class TopBoxes(torch.nn.Module):
    """A detection head: conv, the 5 best of its anchors by score, their 4 box coordinates."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 9, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.conv(x).flatten(2).permute(0, 2, 1)  # [B, HW, 9]
        index = p[..., 4].topk(5, dim=1).indices
        return p.gather(1, index.unsqueeze(-1).expand(-1, -1, 4))  # index [B, 5, 4]: smaller in dim 2


def test_top_k_box_gather_compiles_and_the_conv_runs_in_openvino():
    """OpenVINO refused the GatherElements ('Shapes [1,256,9] and [1,5,4] are not consistent'), so
    the partition failed to compile and the conv ran in reference form."""
    torch.manual_seed(0)
    calibration = [(torch.randn(2, 3, 16, 16),) for _ in range(4)]
    observed = qp.calibrate(qp.prepare_fx(TopBoxes().eval(), None, calibration[0], backend="openvino"),
                            calibration)
    reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no compile failure, no contract fallback
        ov_model = qp.convert_fx(observed)
    assert qp.quantization_report(ov_model).kernels == {"conv": "delegate:delegate_0"}
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = reference(x)
        assert (ov_model(x) - expected).abs().max() <= output_step(expected)


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


class SparseGCN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        adjacency = torch.sparse_coo_tensor(edge_index, torch.ones(edge_index.shape[1]), (n, n))
        return self.l2(torch.relu(torch.sparse.mm(adjacency, self.l1(x))))


def sparse_graphs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(20, 16, generator=generator), torch.randint(0, 20, (2, 60), generator=generator)


@pytest.mark.parametrize(("make_model", "data", "capture"), [
    (functools.partial(SegmentMeanPool, include_self=False), graphs, "auto"),
    (functools.partial(SegmentMeanPool, include_self=True), graphs, "auto"),
    # the exporter renamed the input ``edge_index`` to ``edge_index_orig``: "ValueError: 'edge_index_orig'
    # is not in list" failed the partition of l1
    (SparseGCN, sparse_graphs, "export"),
], ids=["mean-pool", "mean-pool-include-self", "sparse-mm-export"])
def test_gnn_layers_run_in_openvino_as_the_reference_form_says(make_model, data, capture):
    torch.manual_seed(0)
    model = make_model()
    calibration = [data(seed) for seed in range(4)]
    observed = qp.calibrate(qp.prepare_fx(model.eval(), None, calibration[0], backend="openvino",
                                          capture=capture), calibration)
    reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no compile failure, no contract fallback
        ov_model = qp.convert_fx(observed)
    kernels = qp.quantization_report(ov_model).kernels
    assert sorted(kernels) == sorted(name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert all(kernel.startswith("delegate:") for kernel in kernels.values())
    with torch.no_grad():
        for seed in range(10, 12):
            expected = reference(*data(seed))
            assert (ov_model(*data(seed)) - expected).abs().max() <= output_step(expected)


class SkipConcat(torch.nn.Module):
    """A UNet level: encoder conv, strided conv down, bilinear upsample to the skip's size, concat
    with the skip, decoder conv, 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        conv = functools.partial(torch.nn.Conv2d, kernel_size=3, padding=1)
        self.enc, self.down, self.mid = conv(3, 8), torch.nn.Conv2d(8, 8, 2, 2), conv(8, 8)
        self.dec, self.head = conv(16, 8), torch.nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.enc(x))
        low = torch.relu(self.mid(self.down(skip)))
        up = torch.nn.functional.interpolate(low, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.head(torch.relu(self.dec(torch.cat([up, skip], 1))))


@pytest.mark.slow
def test_a_unet_skip_concat_runs_in_openvino_as_the_reference_form_says():
    """OpenVINO computed the concat of a partition with symbolic height and width that upsamples
    wrong (22 dB from the reference form here; the dense explorer's UNet 33 dB vs float where its
    reference form gave 53): such a partition is compiled for its input shape."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.calibrate(qp.prepare_fx(SkipConcat().eval(), None, data[0], backend="openvino"), data[:2])
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        ov_model = qp.convert_fx(observed)
    assert [p["module"] for p in qp.quantization_report(ov_model).partitions] == ["OpenVinoPartition"]
    with torch.no_grad():
        expected, got = reference(*data[2]), ov_model(*data[2])
    assert 10 * torch.log10(expected.pow(2).mean() / (got - expected).pow(2).mean()) > 40

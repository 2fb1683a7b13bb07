"""``to_onnx_proto(..., flexible=True)``, the export of a compiled partition (issue 25): every axis
symbolic where the graph leaves it free, so one runtime session serves every batch size, sequence
and time length; a size the graph fixes or bounds from above stays static, and a smallest size
the graph needs is written beside the shapes, never a symbolic input that would run a graph
traced for other sizes."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.export import export

from qplug_core.onnx_export import dynamic_axes, to_onnx_proto


class Tokens(nn.Module):
    def forward(self, x, mask):
        return torch.relu(x) * mask.unsqueeze(-1)


class Branches(nn.Module):
    def forward(self, x):
        return torch.relu(x) if x.shape[1] > 4 else x  # traced for long sequences only


class Capped(nn.Module):
    def forward(self, x):
        return torch.relu(x) if x.shape[1] < 9 else x  # traced for short sequences only


class Patches(nn.Module):
    """A ViT's patch embedding: the table added to the patches fixes their count, in the graph."""

    def __init__(self):
        super().__init__()
        self.conv, self.pos = nn.Conv2d(1, 4, 4, stride=4), nn.Parameter(torch.randn(1, 4, 4))

    def forward(self, x):
        return self.conv(x).flatten(2).transpose(1, 2) + self.pos


class Masked(nn.Module):
    """Tokens of width 8 (a linear fixes it) times their mask: batch and sequence tied across inputs."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.linear(x) * mask.unsqueeze(-1)


def _dims(proto) -> list[list]:
    return [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input]


def _exported(model, inputs):
    return export(model, inputs, dynamic_shapes=dynamic_axes.flexible_shapes(inputs))


def test_every_free_axis_becomes_a_symbol_shared_where_the_graph_ties_them():
    x, mask = torch.randn(3, 7, 5), torch.ones(3, 7)
    (xb, xs, width), (mb, ms) = _dims(to_onnx_proto(fx.symbolic_trace(Tokens()), (x, mask), flexible=True))
    assert all(isinstance(size, str) for size in (xb, xs, width))  # the last axis too (a signal's time)
    assert (mb, ms) == (xb, xs)


def test_an_axis_of_size_one_stays_static():
    shapes = dynamic_axes.flexible_shapes((torch.randn(1, 7, 5), torch.ones(1, 7), 3))
    assert [sorted(s) if s else s for s in shapes] == [[1, 2], [1], None]


def test_free_sizes_pass_with_their_smallest_size_and_sizes_bounded_above_do_not():
    assert dynamic_axes.free_symbols_only(_exported(Tokens(), (torch.randn(3, 7, 5), torch.ones(3, 7))))
    branches = _exported(Branches(), (torch.randn(3, 7, 5),))
    assert dynamic_axes.free_symbols_only(branches)
    assert sorted(dynamic_axes.min_sizes(branches).values()) == [2, 2, 5]  # batch, width; sequence > 4
    assert not dynamic_axes.free_symbols_only(_exported(Capped(), (torch.randn(3, 7, 5),)))


def test_the_smallest_sizes_decide_which_inputs_a_model_takes():
    conv = fx.symbolic_trace(nn.Conv1d(2, 4, 3))  # no padding: 3 steps at least
    proto = to_onnx_proto(conv, (torch.randn(3, 2, 16),), flexible=True)
    shapes = dynamic_axes.InputShapes.of(proto.SerializeToString())
    assert shapes.fit([torch.randn(2, 2, 3)]) and shapes.fit([torch.randn(4, 2, 1000)])
    assert not shapes.fit([torch.randn(2, 2, 2)]) and not shapes.fit([torch.randn(2, 3, 16)])
    assert not shapes.fit([torch.randn(1, 2, 16)]) and not shapes.fit([torch.randn(3, 2, 16).double()])


def test_axes_the_layers_fix_without_a_guard_are_exported_static_in_one_export(capfd, monkeypatch):
    """torch.export keeps height and width symbolic before a linear that fixes their product; the
    probe at doubled sizes that finds it out runs before the export (after it, it cost a second
    export) and fails quietly (torch.fx printed the graph's code on stderr at each such probe:
    ten times during a ViT's quantize on onnxruntime)."""
    exports = []
    export_once = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: exports.append(k["dynamic_shapes"]) or export_once(*a, **k))
    head = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    (dims,) = _dims(to_onnx_proto(fx.symbolic_trace(head), (torch.randn(2, 1, 8, 8),), flexible=True))
    assert isinstance(dims[0], str) and dims[1:] == [1, 8, 8]
    (dims,) = _dims(to_onnx_proto(fx.symbolic_trace(Patches()), (torch.randn(2, 1, 8, 8),), flexible=True))
    assert isinstance(dims[0], str) and dims[1:] == [1, 8, 8]  # the position table fixes the patches
    assert [sorted(shape) for shape, in exports] == [[0], [0]]  # one export each, only the batch symbolic
    assert "FX-traced Module" not in capfd.readouterr().err


def test_axes_tied_by_the_graph_are_probed_together():
    """A mask's batch and sequence vary with the tokens' (one size each, doubled together); a
    width the layers fix stays static, without fixing the sizes it shares a value with."""
    gm = fx.symbolic_trace(Masked())
    assert dynamic_axes.free_axes(gm, (torch.randn(3, 8, 8), torch.ones(3, 8))) == [{0, 1}, {0, 1}]


def test_sizes_the_exporter_leaves_symbolic_but_pinned_to_one_value_are_written_static(monkeypatch):
    """In ResNet's side-by-side region graph ``Dim.AUTO`` leaves a 1x1 strided conv's input
    channels as ``s50`` bounded to [64, 64] instead of 64: those are static sizes, written as such,
    not a reason to export the whole graph a second time with static shapes (it doubled every
    multi-region partition's compile)."""
    import warnings

    import qplug_core as qp
    from qplug_core.plugin_api import layer_parity

    exports = []
    export_once = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: exports.append(k["dynamic_shapes"]) or export_once(*a, **k))
    model = qp.zoo.get_model("resnet18", seed=0)
    data = [(torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(s)),) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, data[0], backend="reference")
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        protos = []
        layer_parity(reference, lambda graph, example: protos.append(to_onnx_proto(graph, example, flexible=True))
                     or graph, data[0])
    assert len(exports) == 1 and exports[0] is not None  # one export, with flexible axes
    channels = {i.name: d[1] for i, d in zip(protos[0].graph.input, _dims(protos[0]))}
    into_layer2 = {name: c for name, c in channels.items() if "layer1_1_relu_1_quantize" in name}
    assert len(into_layer2) == 2 and set(into_layer2.values()) == {64}, channels

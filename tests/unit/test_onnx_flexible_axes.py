"""``to_onnx_proto(..., flexible=True)``, the export of a compiled partition (issue 25): axes 0 and
1 symbolic where the graph leaves them free, so one runtime session serves every batch size and
sequence length; a size the graph fixes, ties to another or bounds stays static, never a
symbolic input that would run a graph traced for other sizes."""

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


class Derived(nn.Module):
    def forward(self, x, y):
        return x.reshape(x.shape[0], -1) + y  # y's width is x's axes 1 and 2 multiplied


def _dims(proto) -> list[list]:
    return [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input]


def _exported(model, inputs):
    return export(model, inputs, dynamic_shapes=dynamic_axes.flexible_shapes(inputs))


def test_batch_and_sequence_become_symbols_shared_where_the_graph_ties_them():
    x, mask = torch.randn(3, 7, 5), torch.ones(3, 7)
    (xb, xs, width), (mb, ms) = _dims(to_onnx_proto(fx.symbolic_trace(Tokens()), (x, mask), flexible=True))
    assert isinstance(xb, str) and isinstance(xs, str) and width == 5  # axis 2 is never made symbolic
    assert (mb, ms) == (xb, xs)


def test_an_axis_of_size_one_stays_static():
    shapes = dynamic_axes.flexible_shapes((torch.randn(1, 7, 5), torch.ones(1, 7), 3))
    assert [sorted(s) if s else s for s in shapes] == [[1], [1], None]


def test_free_sizes_pass_and_bounded_or_derived_ones_do_not():
    assert dynamic_axes.free_symbols_only(_exported(Tokens(), (torch.randn(3, 7, 5), torch.ones(3, 7))))
    assert not dynamic_axes.free_symbols_only(_exported(Branches(), (torch.randn(3, 7, 5),)))
    assert not dynamic_axes.free_symbols_only(_exported(Derived(), (torch.randn(3, 4, 2), torch.randn(3, 8))))


def test_a_graph_tying_sizes_beyond_equality_is_exported_static():
    proto = to_onnx_proto(fx.symbolic_trace(Derived()), (torch.randn(3, 4, 2), torch.randn(3, 8)), flexible=True)
    assert _dims(proto) == [[3, 4, 2], [3, 8]]


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

"""``nn_module_stack`` stays in torch's own form through every qplug pass (issue 25).

A partition of an exported model is exported again (the ONNX exporter runs torch.export on it),
and torch.export refuses a graph whose stack is not ``{key: (path, "qualified.ClassName")}``:
qplug once rewrote it into the tracer's form (classes, ``None`` for unknown paths), and every BERT
or ``nn.MultiheadAttention`` model fell back to float on onnxruntime. And a qconfig set for a
module type still reaches the functions inside that module at the export level.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.ir import module_stack

pytestmark = pytest.mark.slow  # torch.export, ~10 s


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.attn(y, y, y, need_weights=False)[0] + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x) * 2.0)


def _data(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed)),)


def _export_form(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes whose stack torch.export's verifier would refuse (``Dict[str, Tuple[str, str]]``)."""
    bad = []
    for node in gm.graph.nodes:
        stack = node.meta.get(module_stack.KEY)
        if node.op in ("call_function", "get_attr") and stack is not None and not all(
                isinstance(k, str) and isinstance(v, tuple) and len(v) == 2
                and all(isinstance(part, str) for part in v) for k, v in stack.items()):
            bad.append(f"{node.name}: {stack}")
    return bad


@pytest.mark.parametrize("given", ["module", "exported_program"])
def test_every_stage_keeps_export_form_and_the_reference_form_exports_again(given):
    torch.manual_seed(0)
    model = Net().eval()
    if given == "exported_program":  # captured by the user: qplug raises a graph it did not export
        model = torch.export.export(model, _data(0), strict=False)
    observed = qp.prepare_fx(model, None, _data(0), backend="reference", capture="export")
    assert _export_form(observed) == []
    qp.calibrate(observed, [_data(1), _data(2)])
    reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
    assert _export_form(reference) == []
    # what the ONNX exporter does with every partition: no SpecViolationError
    program = torch.export.export(reference, _data(3), strict=False)
    torch.testing.assert_close(program.module()(*_data(3)), reference(*_data(3)))


def _quantized_at_export_level(model: nn.Module, mapping) -> set[str]:
    observed = qp.prepare_fx(copy.deepcopy(model), mapping, _data(0), backend="reference", capture="export")
    qp.calibrate(observed, [_data(1)])
    return set(qp.quantization_report(qp.convert_fx(observed)).quantized)


def test_a_qconfig_for_a_module_type_reaches_the_functions_inside_it_at_export_level():
    torch.manual_seed(0)
    model = Net().eval()
    everything = _quantized_at_export_level(model, None)
    assert "add" in everything  # Block's residual add
    mapping = qp.get_default_qconfig_mapping("reference").set_object_type(Block, None)
    without_block = _quantized_at_export_level(model, mapping)
    assert "add" not in without_block  # matched by the class name export recorded
    assert {"block.fc", "head"} <= without_block  # modules resolve by their own type, as in torch.ao


def test_stack_helpers_read_both_forms():
    traced = torch.fx.symbolic_trace(Net())
    node = next(n for n in traced.graph.nodes if n.op == "call_function" and "mul" in n.name)
    assert module_stack.innermost(node) == ("", None)  # Net.forward: the root
    exported = torch.export.export(Net().eval(), _data(0), strict=False).module()
    add = next(n for n in exported.graph.nodes if n.op == "call_function" and n.name.startswith("add"))
    path, type_name = module_stack.innermost(add)
    assert (path, type_name) == ("block", f"{__name__}.Block")
    assert module_stack.resolve_type(type_name, [nn.Linear, Block]) is Block
    assert module_stack.resolve_type(type_name, [nn.Linear]) is None

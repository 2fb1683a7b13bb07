"""An ExportedProgram's relations between input sizes survive quantization (an outside tester's
report F5, session 28): HF ViT exported with dynamic H/W holds ``H//16 * W//16 == 36``; the float
program refused 128 px with torch's guard, the quantized one ran into "The size of tensor a (65)
must match the size of tensor b (37)" deep in its graph. Here a patch embedding added to a fixed
table of 16 positions holds ``H//4 * W//4 == 16``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class PatchTable(nn.Module):
    """4x4 patches plus a table of 16 positions: any image of 16 patches fits."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.patch(x).flatten(2).transpose(1, 2) + self.pos)


def _program(dynamic_hw: bool) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    sizes = {0: Dim("b")}
    if dynamic_hw:
        sizes.update({2: 4 * Dim("h", min=1, max=32), 3: 4 * Dim("w", min=1, max=32)})
    return torch.export.export(PatchTable().eval(), (torch.randn(2, 3, 16, 16),), dynamic_shapes=(sizes,))


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    return _program(dynamic_hw=True)


@pytest.fixture(scope="module")
def int8(program) -> nn.Module:
    torch.manual_seed(1)
    batches = [(torch.randn(2, 3, 16, 16),) for _ in range(2)] + [(torch.randn(3, 3, 32, 8),)]
    return qp.quantize(program, batches[0], batches, backend="fbgemm")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_a_size_breaking_the_programs_relation_is_refused_naming_it(program, int8):
    """32x32 px is 64 patches: the float program's guard refuses it (AssertionError), and so does
    the int8 one, with qplug's error naming the input sizes and the relation, before the graph runs."""
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(AssertionError, match="Guard failed"):
        program.module()(x)
    with pytest.raises(InputMismatchError, match=r"x.shape\[2\]=32, x.shape\[3\]=32 break "
                                                 r"`x.shape\[2\] // 4 \* \(x.shape\[3\] // 4\) == 16`") as caught:
        int8(x)
    assert isinstance(caught.value, AssertionError)  # what the float program raises


def test_a_size_outside_the_programs_range_is_refused(int8):
    """``4*Dim("w", max=32)``: 200 px is refused naming the range, before any relation."""
    with pytest.raises(InputMismatchError, match=r"x.shape\[3\] is 200 .*outside the range 4..128"):
        int8(torch.randn(1, 3, 4, 200))


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 3, 32, 8), (3, 3, 8, 32)])
def test_sizes_keeping_the_relation_run_as_the_float_program(program, int8, shape):
    """Every size of 16 patches runs, at any batch, close to the float program."""
    torch.manual_seed(2)
    x = torch.randn(shape)
    with torch.no_grad():
        assert _cosine(int8(x), program.module()(x)) > 0.99


def test_a_program_without_relations_keeps_its_fixed_sizes_only():
    """Dynamic batch, fixed 16x16: another batch runs, another width gets the fixed-size error as
    before (no relation to name)."""
    torch.manual_seed(1)
    example = (torch.randn(2, 3, 16, 16),)
    int8 = qp.quantize(_program(dynamic_hw=False), example, [example], backend="fbgemm")
    with torch.no_grad():
        assert int8(torch.randn(5, 3, 16, 16)).shape == (5, 16, 4)
    with pytest.raises(InputMismatchError, match=r"input 'x' has size 32 at dim 3 \(captured with 16\)"):
        int8(torch.randn(2, 3, 16, 32))

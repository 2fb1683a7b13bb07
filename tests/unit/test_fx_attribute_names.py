"""torch.fx code reaches submodules whose names are keywords or need quoting (pytorch#188538)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import qplug_core.ir  # noqa: F401 - installs the fixed formatter
from qplug_core.ir.fx_attribute_names import format_target


class _Pick(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.heads = nn.ModuleDict({name: nn.Linear(4, 4), "there": nn.Linear(4, 4)})
        self.name = name

    def forward(self, x):
        return self.heads[self.name](x)


@pytest.mark.parametrize("name", ["class", "None", 'say"hi', "back\\there", "match", "héad"])
def test_traced_code_calls_the_submodule_of_that_name(name):
    """Keywords were written ``self.heads.class`` (SyntaxError); a quote broke the literal; a
    backslash turned ``back\\there`` into ``back<TAB>here``."""
    model = _Pick(name)
    traced = fx.symbolic_trace(model)
    assert format_target("self", f"heads.{name}") in traced.code
    x = torch.randn(2, 4)
    assert torch.equal(traced(x), model(x))


def test_plain_and_soft_keyword_names_keep_attribute_syntax():
    assert format_target("self", "layer1.0.match") == "getattr(self.layer1, '0').match"
    assert format_target("self", "heads.class") == "getattr(self.heads, 'class')"

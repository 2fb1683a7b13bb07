"""torch.fx code for submodules named after Python keywords (``heads["class"]``).

torch 2.13's ``torch.fx.graph._format_target`` writes ``self.heads.class`` for such a name, which
is a SyntaxError, so neither symbolic tracing nor torch.export can capture the model (pytorch
issue 188538, fix in review as PR 191687). A name with a quote or backslash is spliced into a
string literal unescaped: invalid code, or silently another attribute. This installs the fixed
formatter (``getattr(self.heads, 'class')``, ``repr`` quoting) only while torch still has the bug.
"""

from __future__ import annotations

import keyword

import torch.fx.graph as fx_graph


def format_target(base: str, target: str) -> str:
    """Python code reaching ``target`` (a dotted attribute path) from ``base``."""
    code = base
    for part in target.split("."):
        plain = part.isidentifier() and not keyword.iskeyword(part)
        code = f"{code}.{part}" if plain else f"getattr({code}, {part!r})"
    return code


def install() -> None:
    """Use :func:`format_target` in torch.fx's code generation if torch's own gets these names wrong."""
    if fx_graph._format_target("self", "class") != format_target("self", "class"):
        fx_graph._format_target = format_target


__all__ = ["format_target", "install"]

"""The core's modules form layers: every import between two parts of ``qplug_core`` is an allowed
edge below, and the allowed edges have no cycle.

A *part* is a top-level module or subpackage of ``qplug_core`` (``flows``, ``fx``, ``kernels``...).
Imports are read with ``ast`` from the source, wherever they are (module level or inside a
function: a call-time import is still a dependency), except under ``if TYPE_CHECKING:``, which
only annotations see. To add an edge, add it to :data:`ALLOWED`; the acyclicity test says whether
it creates a cycle.
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import qplug_core

PACKAGE = Path(qplug_core.__file__).resolve().parent
#: ``import qplug_core`` / its lazy names: the public facade, for the top layer only
FACADE = "qplug_core"

#: part -> the parts it may import (leaf modules first, the facade's users last)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "enums": set(),
    "audience": set(),
    "plugin_isolation": {"errors"},
    "qparams": {"errors"},
    "patterns": {"errors"},
    "subgraph_matcher": {"errors", "ir"},
    "report": {"errors"},
    "ir": {"errors", "qparams"},
    "nn": {"errors"},
    "zoo": {"errors"},
    "contract": {"errors"},
    "hookspecs": set(),
    "matcher": {"errors", "patterns", "subgraph_matcher"},
    "passes": {"errors", "subgraph_matcher"},
    "observers": {"errors", "qparams"},
    "kernels": {"errors", "ir", "nn", "qparams"},
    "config": {"errors", "observers", "patterns"},
    "plugins": {"errors", "hookspecs", "plugin_isolation"},
    "backend_configs": {"config", "errors", "nn"},
    "qconfig_defaults": {"config", "enums", "errors", "observers"},
    "fx": {"audience", "config", "errors", "ir", "kernels", "matcher", "nn", "observers", "passes", "patterns",
           "qparams"},
    "backend": {"audience", "config", "contract", "enums", "errors", "fx", "patterns", "plugins"},
    "reference_backend": {"backend_plugin"},
    "partition": {"backend", "errors", "fx", "ir"},
    "delegation": {"errors", "fx", "partition"},
    "finish": {"backend", "delegation", "fx", "ir", "kernels"},
    "weight_only": {"backend", "errors", "plugins"},
    "serialization": {"backend", "config", "errors", "finish", "fx", "kernels", "plugins", "qparams",
                      "weight_only"},
    "distributed": {"errors", "observers"},
    "flow_checks": {"errors", "fx", "kernels", "observers"},
    "flows": {"backend", "config", "distributed", "errors", "finish", "flow_checks", "report", "fx", "passes", "serialization"},
    "algorithms": {"backend", "config", "errors", "flows", "fx", "kernels", "nn", "qparams", "report"},
    "one_call": {"algorithms", "backend", "config", "flow_checks", "flows"},
    "dynamic": {"backend", "config", "errors", "flows", "fx", "kernels", "qconfig_defaults",
                "qparams"},
    "eager": {"backend", "config", "errors", "flows", "fx", "kernels", "nn", "observers", "qparams"},
    "backend_plugin": {"backend_configs", "contract", "errors", "hookspecs", "kernels",
                       "qconfig_defaults"},
    "onnx_export": {"errors", "flows", "fx", "ir", "kernels", "nn", "qparams", "serialization"},
    "plugin_api": {"backend_configs", "backend_plugin", "config", "contract", "delegation", "enums",
                   "errors", "fx", "hookspecs", "kernels", "onnx_export", "partition", "passes",
                   "plugins", "qconfig_defaults", "qparams", "testing", "weight_only"},
    "testing": {"backend", "config", "flows", "fx", "kernels", "nn", "partition", "patterns", "plugins",
                "weight_only", "zoo",
                FACADE},
    "pytest_plugin": {"plugins", "testing"},
    "commands": {"backend", "distributed", "enums", "errors", "flows", "kernels", "onnx_export",
                 "patterns", "plugin_isolation", "serialization", "zoo", FACADE},
    "cli": {"audience", "backend", "commands", "errors", "plugins"},
    # the facade imports its exports lazily, by name: see facade_edges()
    FACADE: {"algorithms", "backend", "config", "distributed", "dynamic", "eager", "errors", "flows",
             "hookspecs", "one_call",
             "matcher", "observers", "onnx_export", "partition", "passes", "patterns", "report",
             "serialization", "weight_only", "zoo"},
}


def part_of(module: str) -> str | None:
    """``qplug_core.fx.lower`` -> ``fx``; ``qplug_core`` -> the facade; elsewhere ``None``."""
    if module == FACADE:
        return FACADE
    if not module.startswith(FACADE + "."):
        return None
    return module.split(".")[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            guarded |= {id(child) for statement in node.body for child in ast.walk(statement)}
    return guarded


def imported_parts(path: Path) -> dict[str, int]:
    """The parts ``path`` imports at run time, each with the line of its first import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _type_checking_nodes(tree)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == FACADE:  # from qplug_core import plugins: a submodule, else the facade
                modules = [f"{FACADE}.{a.name}" if (PACKAGE / a.name).exists()
                           or (PACKAGE / f"{a.name}.py").exists() else FACADE for a in node.names]
        else:
            continue
        for module in modules:
            part = part_of(module)
            if part is not None:
                found.setdefault(part, node.lineno)
    return found


def source_part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return FACADE if relative == Path("__init__.py") else relative.parts[0].removesuffix(".py")


def facade_edges() -> dict[tuple[str, str], str]:
    """What ``qplug_core/__init__.py`` imports on first use of a name (strings, invisible to ast)."""
    return {(FACADE, part_of(target.partition(":")[0])): f"qplug_core/__init__.py: {name!r}"
            for name, target in qplug_core._EXPORTS.items()}


def edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> where, for every import between two different parts."""
    found: dict[tuple[str, str], str] = facade_edges()
    for path in sorted(PACKAGE.rglob("*.py")):
        source = source_part(path)
        for part, line in imported_parts(path).items():
            if part != source:
                found.setdefault((source, part), f"{path.relative_to(PACKAGE.parent)}:{line}")
    return found


def test_every_import_is_an_allowed_edge():
    bad = [f"{where}: {a} -> {b}" for (a, b), where in sorted(edges().items())
           if b not in ALLOWED.get(a, set())]
    assert not bad, ("imports across layers that qplug does not allow (move the code, or add the "
                     "edge to ALLOWED if it keeps the graph acyclic):\n" + "\n".join(bad))


def test_allowed_edges_are_acyclic():
    try:
        order = list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as exc:
        pytest.fail(f"ALLOWED has a cycle: {' -> '.join(exc.args[1])}")
    assert set(order) >= set(ALLOWED)


def test_every_part_is_listed():
    parts = {source_part(p) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(ALLOWED), f"parts with no layer: {sorted(parts - set(ALLOWED))}"


def test_the_reader_sees_call_time_imports_but_not_annotations(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from qplug_core.backend import Backend\n"
                      "def f():\n    from qplug_core.flows import fuse_fx\n"
                      "from qplug_core import plugins, quantize\n")
    assert imported_parts(sample) == {"flows": 5, "plugins": 6, FACADE: 6}


REPO = PACKAGE.parent
#: code written as a backend author would: the in-tree plugins, the scaffold, the tutorial
PLUGIN_CODE = [*REPO.glob("plugins/*/**/*.py"), *REPO.glob("qplug_core/templates/new_backend/*.py.tmpl"),
               *REPO.glob("docs_src/plugin_tiny/**/*.py")]


def test_plugins_import_only_the_plugin_api_and_the_facade():
    allowed = {FACADE, f"{FACADE}.plugin_api"}
    bad = []
    for path in PLUGIN_CODE:
        source = re.sub(r"\{\{(\w+)\}\}", r"X_\1", path.read_text())  # template placeholders
        for node in ast.walk(ast.parse(source, filename=str(path))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno}: {m}" for m in modules
                    if part_of(m) is not None and m not in allowed]
            if isinstance(node, ast.ImportFrom) and node.module == FACADE:
                bad += [f"{path.relative_to(REPO)}:{node.lineno}: qplug_core.{a.name}" for a in node.names
                        if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists()]
    assert len(PLUGIN_CODE) >= 10
    assert not bad, "plugins import internal modules:\n" + "\n".join(bad)

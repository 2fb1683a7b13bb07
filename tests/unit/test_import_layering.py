"""The core's modules form layers: every import between two parts of ``qplug_core`` is an allowed
edge below, and the allowed edges have no cycle.

A *part* is a top-level module or subpackage of ``qplug_core`` (``flows``, ``fx``, ``kernels``...).
Imports are read with ``ast`` from the source, wherever they are: module level, inside a function
(a call-time import is still a dependency) and under ``if TYPE_CHECKING:`` (an annotation that
names a higher layer is a dependency too: a lazy or guarded import is no way around a cycle). To add an edge, add it to :data:`ALLOWED`; the acyclicity test says whether
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

#: part -> the parts it may import, mechanism first, the pipeline in the middle, its users last
ALLOWED: dict[str, set[str]] = {
    # leaves and the graph mechanism (torch.fx-like: no quantization pipeline below here)
    "errors": set(),
    "enums": set(),
    "qparams": {"errors"},
    "patterns": {"errors"},
    "nn": {"errors", "ir"},
    "zoo": {"errors"},
    "ir": {"errors", "qparams"},
    "matcher": {"errors", "ir", "patterns"},
    "passes": {"errors", "ir"},
    "partition": {"errors", "ir"},
    # numerics and configuration data
    "observers": {"errors", "ir", "qparams"},
    "kernels": {"errors", "ir", "nn", "qparams"},
    "config": {"enums", "errors", "nn", "observers", "patterns"},
    # the plugin host, then the pipeline that consults it
    "registry": {"config", "enums", "errors", "kernels", "partition", "patterns"},
    "flows": {"config", "enums", "errors", "ir", "kernels", "matcher", "nn", "observers", "partition", "passes",
              "patterns", "qparams", "registry"},
    # weight-only quantization: module swap beside the graph pipeline, kernels chosen per CPU
    "weight_only": {"errors", "flows", "ir", "kernels", "nn", "registry"},
    # above the pipeline
    "serialization": {"config", "errors", "flows", "ir", "kernels", "nn", "partition", "qparams", "registry",
                      "weight_only"},
    "analysis": {"errors", "flows", "ir", "kernels", "partition", "patterns", "registry", "serialization"},
    "eager": {"config", "enums", "errors", "flows", "ir", "kernels", "nn", "observers", "qparams", "registry"},
    "algorithms": {"analysis", "config", "errors", "flows", "ir", "kernels", "nn", "observers", "qparams"},
    "onnx_export": {"errors", "flows", "ir", "kernels", "nn", "partition", "qparams", "serialization"},
    "pt2_export": {"errors", "flows", "onnx_export", "registry"},
    "one_call": {"algorithms", "config", "errors", "flows", "registry", "weight_only"},
    # the facade imports its exports lazily, by name: see facade_edges()
    FACADE: {"algorithms", "analysis", "config", "eager", "errors", "flows", "matcher", "observers",
             "one_call", "onnx_export", "partition", "pt2_export", "passes", "patterns", "registry",
             "serialization", "weight_only", "zoo"},
    "testing": {"config", "errors", "flows", "kernels", "nn", "partition", "patterns", "registry", FACADE},
    "plugin_api": {"config", "enums", "errors", "flows", "kernels", "nn", "onnx_export", "partition",
                   "passes", "qparams", "registry", "testing"},
    "cli": {"enums", "errors", "flows", "ir", "kernels", "observers", "patterns", "registry",
            "serialization", "zoo", FACADE},
}


def part_of(module: str) -> str | None:
    """``qplug_core.flows.lower`` -> ``fx``; ``qplug_core`` -> the facade; elsewhere ``None``."""
    if module == FACADE:
        return FACADE
    if not module.startswith(FACADE + "."):
        return None
    return module.split(".")[1]


def imported_parts(path: Path) -> dict[str, int]:
    """The parts ``path`` imports, each with the line of its first import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == FACADE:  # from qplug_core import errors: a submodule, else the facade
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


def test_the_reader_sees_call_time_and_annotation_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from qplug_core.registry.backends import Backend\n"
                      "def f():\n    from qplug_core.flows.steps import fuse_fx\n"
                      "from qplug_core import errors, quantize\n")
    assert imported_parts(sample) == {"registry": 3, "flows": 5, "errors": 6, FACADE: 6}


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


#: the root of the package holds only the facades and the leaves; everything else has its room
ROOT_MODULES = {"__init__", "plugin_api", "errors", "enums", "one_call", "qparams", "patterns",
                "matcher"}


def test_the_root_holds_only_facades_and_leaves():
    found = {path.stem for path in PACKAGE.glob("*.py")}
    assert found == ROOT_MODULES, (f"new modules at the root of qplug_core: {sorted(found - ROOT_MODULES)}; "
                                   "put them in the package of their stage (docs/code-map.md)")
    assert len(ROOT_MODULES) <= 12

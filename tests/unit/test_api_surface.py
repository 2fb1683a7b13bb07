"""The public surfaces are snapshot-tested, as torch.fx does with its backward-compatibility files.

``tests/api_surface.expect`` lists every name of ``qplug_core.__all__`` (the user API), of the
public namespaces under it (``qp.passes``, ``qp.partition``, ...) and of
``qplug_core.plugin_api.__all__`` (what backends import) with its kind and signature. Any change to
either surface is a failing test until the file is regenerated on purpose::

    QPLUG_ACCEPT_API=1 python -m pytest tests/unit/test_api_surface.py

and the diff of the file is reviewed with the change.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import os
import re
import types
from pathlib import Path

import qplug_core
from qplug_core import plugin_api

EXPECT = Path(__file__).resolve().parents[1] / "api_surface.expect"
ACCEPT = "QPLUG_ACCEPT_API"
#: the user API, the public namespaces it exposes (each with a literal ``__all__``), the plugin API
NAMESPACES = ("algorithms", "analysis", "config", "eager", "matcher", "observers", "partition",
              "passes", "patterns", "zoo")
SURFACES = {"qplug_core": qplug_core,
            **{f"qplug_core.{name}": importlib.import_module(f"qplug_core.{name}") for name in NAMESPACES},
            "qplug_core.plugin_api": plugin_api}


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    text = re.sub(r" at 0x[0-9a-f]+>", ">", text)  # function defaults print their address
    return re.sub(r"frozenset\(\{[^}]*\}\)", "frozenset(...)", text)  # set order varies by run


def _public_methods(cls: type) -> list[str]:
    """Methods a user calls or a subclass overrides: public ones defined by qplug classes."""
    lines = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or not owner.__module__.startswith("qplug_core"):
            continue
        member = vars(owner)[name]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member):
            lines.append(f"    .{name}{_signature(member)}")
        elif isinstance(member, property):
            lines.append(f"    .{name} (property)")
    return lines


def describe(name: str, obj: object) -> list[str]:
    """The lines of the snapshot for one public name."""
    if isinstance(obj, types.ModuleType):
        return [f"{name}: module {obj.__name__}"]
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return [f"{name}: enum {', '.join(f'{m.name}={m.value!r}' for m in obj)}"]
    if isinstance(obj, type):
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        return [f"{name}: class({bases}){_signature(obj)}", *_public_methods(obj)]
    if callable(obj):
        return [f"{name}: function{_signature(obj)}"]
    if isinstance(obj, (set, frozenset)) or " at 0x" in repr(obj):  # varies from run to run
        return [f"{name}: {type(obj).__name__} of {len(obj)}"]
    return [f"{name}: {type(obj).__name__} = {obj!r}"]


def render() -> str:
    lines = ["# Public API of qplug (tests/unit/test_api_surface.py; regenerate with QPLUG_ACCEPT_API=1)"]
    for title, module in SURFACES.items():
        lines.append(f"\n[{title}]")
        for name in module.__all__:
            lines += describe(name, getattr(module, name))
    return "\n".join(lines) + "\n"


def test_api_surface_matches_the_snapshot():
    current = render()
    if os.environ.get(ACCEPT) == "1":
        EXPECT.write_text(current)
    expected = EXPECT.read_text() if EXPECT.exists() else ""
    assert current == expected, (
        f"the public API changed; if that is intended, run {ACCEPT}=1 python -m pytest "
        f"{Path(__file__).relative_to(EXPECT.parents[1])} and commit the diff of {EXPECT.name}")


def _literal_all(module: types.ModuleType) -> list[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module.__name__} has no __all__ assignment")


def test_all_is_a_literal_list_of_resolvable_names():
    for module in (qplug_core, plugin_api):
        names = _literal_all(module)  # raises if __all__ is computed, not written out
        assert names == list(module.__all__) and len(set(names)) == len(names)
        for name in names:
            assert getattr(module, name) is not None


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package: dotted is an attribute
        return False


def test_type_checkers_see_every_lazy_name():
    """``qplug_core/__init__.py`` imports each lazy export under TYPE_CHECKING, from where it lives."""
    tree = ast.parse(Path(qplug_core.__file__).read_text())
    seen: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom)
                for alias in statement.names:
                    dotted = f"{statement.module}.{alias.name}"
                    seen[alias.asname or alias.name] = (
                        dotted if _is_module(dotted) else f"{statement.module}:{alias.name}")
    assert seen == qplug_core._EXPORTS
    assert sorted([*qplug_core._EXPORTS, "__version__"]) == sorted(qplug_core.__all__)


def test_dir_lists_the_lazy_names():
    """Tab completion and ``help()`` show what a plugin may import, the lazily imported ones too."""
    for module in (qplug_core, plugin_api):
        assert set(module.__all__) <= set(dir(module))
    assert "to_onnx_proto" in dir(plugin_api) and "onnx_source" in dir(plugin_api)

"""Annotation keys (``node.meta`` / ``GraphModule.meta``) are named once, in ``qplug_core.flows.tags``.

A key spelled as a literal elsewhere drifts silently when it is renamed, and a plugin reading one
depends on an internal detail; so runtime code may not contain a ``"qplug_..."`` identifier string
other than a hook name or a package name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qplug_core.flows import tags
from qplug_core.registry import hookspecs

REPO = Path(__file__).resolve().parents[2]
RUNTIME = [REPO / "qplug_core", *(REPO / "plugins").glob("*/qplug_*")]
KEY_LIKE = re.compile(r"qplug_\w+\Z")
HOOK_NAMES = {name for name in vars(hookspecs) if name.startswith("qplug_")}
PACKAGES = {"qplug_core", *(p.name for p in (REPO / "plugins").glob("*/qplug_*"))}
TAGS_FILE = Path(tags.__file__).resolve()


def key_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    exported = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                for c in ast.walk(node.value)}  # __all__ names functions, not keys
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported
            and KEY_LIKE.match(node.value) and node.value not in HOOK_NAMES | PACKAGES]


def test_annotation_keys_are_only_spelled_in_tags():
    found = [f"{path.relative_to(REPO)}:{line}: {value!r}"
             for root in RUNTIME for path in sorted(root.rglob("*.py"))
             if path.resolve() != TAGS_FILE for line, value in key_literals(path)]
    assert not found, ("use the constants of qplug_core.flows.tags instead of these literals:\n"
                       + "\n".join(found))


def test_tags_define_each_key_once():
    keys = [value for name, value in vars(tags).items() if name.isupper() and isinstance(value, str)]
    assert keys and len(keys) == len(set(keys))
    assert all(KEY_LIKE.match(key.removeprefix("_")) for key in keys)  # _qplug_: private attributes


def test_the_check_sees_a_literal(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('node.meta["qplug_root"] = True\nplugins.collect("qplug_passes")\n'
                      '__all__ = ["qplug_only"]\n')
    assert key_literals(sample) == [(1, "qplug_root")]

"""``qplug new-backend NAME``: scaffold a third-party backend plugin package that works as is.

Writing a backend means knowing four hooks, the entry-point group and the kernel contract; a
package that installs, lists and quantizes from the first minute is the quickest way to learn them.
"""

from __future__ import annotations

import re
import shutil
from importlib import resources
from pathlib import Path

import typer

#: template file -> path in the new package ({package} is replaced)
TEMPLATES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "__init__.py.tmpl": "{package}/__init__.py",
    "plugin.py.tmpl": "{package}/plugin.py",
    "test_plugin.py.tmpl": "tests/test_plugin.py",
}
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")


def core_requirement(version: str) -> str:
    """The qplug-core a plugin scaffolded now needs: this release or later (no upper bound, so that
    the package installs next to the core it was made with, whether released or a checkout)."""
    from packaging.version import Version

    major, minor = (Version(version).release + (0, 0))[:2]
    return f"qplug-core>={major}.{minor}"


def install_command(root: Path) -> str:
    """``pip install -e ./qplug-x``: the local path, never a name an index could answer for."""
    path = str(root)
    return f"pip install -e {path if root.is_absolute() or path.startswith('.') else './' + path}"


def _check_name(name: str) -> None:
    from qplug_core.errors import ConfigError
    from qplug_core.registry.backends import list_backends

    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"backend name {name!r} must start with a lowercase letter and use only "
                          "lowercase letters, digits and '_' (at most 40), e.g. 'acme_npu'",
                          field="name", value=name)
    if name in {row.name for row in list_backends()}:
        raise ConfigError(f"a backend named {name!r} is already installed; pick another name "
                          "(or extend it from a plugin through qplug_backend_pattern_configs)",
                          field="name", value=name)


def scaffold(name: str, directory: Path) -> Path:
    """Write the plugin package ``qplug-<name>`` under ``directory``; returns its root."""
    import qplug_core
    from qplug_core.errors import ConfigError

    _check_name(name)
    _check_directory(directory)
    root = directory / f"qplug-{name.replace('_', '-')}"
    if root.exists():
        raise ConfigError(f"{root} already exists; remove it or pass another --dir",
                          field="dir", value=str(root))
    values = {"name": name, "dist": root.name, "package": f"qplug_{name}",
              "class_name": "".join(part.title() for part in name.split("_")),
              "core_requirement": core_requirement(qplug_core.__version__)}
    templates = resources.files("qplug_core").joinpath("templates", "new_backend")
    try:
        for template, target in TEMPLATES.items():
            text = templates.joinpath(template).read_text(encoding="utf-8")
            for key, value in values.items():
                text = text.replace("{{" + key + "}}", value)
            path = root / target.format(**values)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as exc:  # unwritable, full or vanished directory: leave no half package behind
        shutil.rmtree(root, ignore_errors=True)
        raise ConfigError(f"cannot create {root}: {exc.strerror or exc}; pass a writable --dir",
                          field="dir", value=str(directory)) from exc
    return root


def _check_directory(directory: Path) -> None:
    from qplug_core.errors import ConfigError

    for parent in (directory, *directory.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--dir {directory}: {parent} is a file, not a directory; pass a "
                                  "directory (it is created if missing)", field="dir",
                                  value=str(directory))
            return


def new_backend(
    name: str = typer.Argument(..., help="Backend name, e.g. acme_npu (package qplug-acme-npu)."),
    directory: Path = typer.Option(Path("."), "--dir", help="Where to create the package."),
) -> None:
    """Scaffold a backend plugin package: pyproject with the entry point, hooks, README, a test."""
    root = scaffold(name, directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        typer.echo(str(path))
    typer.echo(f"next: {install_command(root)} && qplug list-backends && qplug show-backend {name}",
               err=True)


def register(app: typer.Typer) -> None:
    app.command("new-backend")(new_backend)

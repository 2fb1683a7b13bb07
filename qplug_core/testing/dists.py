"""Installed-looking plugin distributions written into a directory: the one dist-info writer.

``pip install`` leaves ``<name>-<version>.dist-info/{METADATA,entry_points.txt}`` in site-packages,
and that is all ``importlib.metadata`` reads to discover a plugin. Writing the same files into a
directory on ``sys.path`` runs the real discovery and entry-point loading, in milliseconds.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from qplug_core.registry import plugins

if TYPE_CHECKING:
    import subprocess

    import pytest


def write_dist_info(root: Path, dist: str, version: str, entry_points: Mapping[str, str], *,
                    requires: tuple[str, ...] = ()) -> Path:
    """Write the metadata of distribution ``dist`` with ``qplug`` entry points into ``root``."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {line}" for line in requires]
    (info / "METADATA").write_text("\n".join(metadata) + "\n")
    lines = [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join([f"[{plugins.ENTRY_POINT_GROUP}]", *lines]) + "\n")
    return info


def child_venv(root: Path) -> Path:
    """A fresh venv at ``root`` that also sees this interpreter's packages; returns its python.

    For tests that ``pip install`` a plugin for real, offline and fast: the venv has no pip and no
    packages of its own; this environment's site-packages (torch, qplug-core's editable install)
    are chained in through a ``.pth`` file, and packages installed into the venv shadow nothing.
    """
    import subprocess
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "_parent_venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python


def pip_install_into(python: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``pip install ARGS`` into the venv of ``python``, offline (no index, no build isolation)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    env.update(PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


class FakeDists:
    """The ``fake_dist`` fixture: each call makes one discoverable distribution, loaded alone.

    Only the fake distributions written so far (and the core's built-in plugins) load, through
    ``QPLUG_LOAD_PLUGINS``, whatever else is installed.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []
        self.dists: list[str] = []

    def __call__(self, dist: str, source: str | None = None, *, entry_point: str | None = None,
                 module: str | None = None, version: str = "0.1", requires: tuple[str, ...] = (),
                 subdir: str = "", location: Path | None = None) -> Path:
        """Write distribution ``dist`` whose ``qplug`` entry point ``entry_point`` names ``module``.

        ``module`` may be ``"pkg.mod:object"``. ``source`` is the module's code (``None``: write no
        module, e.g. it exists already under ``location`` or is missing on purpose). ``subdir``
        puts the distribution on its own ``sys.path`` entry (two copies of one distribution);
        ``location`` is the directory of an existing package's source (a checkout), put on
        ``sys.path`` too, as an editable install does; nothing is written there.
        """
        module = module or dist.replace("-", "_")
        entry_point = entry_point or dist.removeprefix("qplug-")
        root = self.root / subdir if subdir else self.root
        write_dist_info(root, dist, version, {entry_point: module}, requires=requires)
        module_name = module.partition(":")[0]
        if source is not None:
            (root / f"{module_name}.py").write_text(textwrap.dedent(source))
        self.modules.append(module_name)
        for path in (location, root):
            if path is not None and str(path) not in sys.path:
                self.monkeypatch.syspath_prepend(path)
        self.dists.append(dist)
        self.monkeypatch.setenv(plugins.ENV_LOAD, ",".join(self.dists))
        importlib.invalidate_caches()
        plugins.reset()
        return root

    def forget_modules(self) -> None:
        """Drop the fake plugins' modules (and their packages' submodules) from ``sys.modules``."""
        for name in self.modules:
            top = name.split(".")[0]
            if top == "qplug_core":
                continue
            for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[loaded]


__all__ = ["FakeDists", "child_venv", "pip_install_into", "write_dist_info"]

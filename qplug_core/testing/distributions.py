"""Real, discoverable plugin distributions written into a directory, for plugin tests.

Each call writes ``<name>-<version>.dist-info/{METADATA,entry_points.txt}`` plus the plugin module
into a directory that is prepended to ``sys.path``, so discovery runs through the real
``importlib.metadata`` and entry-point loading, exactly as for an installed wheel. Only the fake
distributions (and the built-in plugins) are loaded, through ``QPLUG_LOAD_PLUGINS``, whatever else
is installed. The same directory on ``PYTHONPATH`` makes them visible to a ``qplug`` subprocess.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from qplug_core import plugins


class FakeDists:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []
        self.dists: list[str] = []

    def __call__(self, dist: str, source: str | None = None, *, entry_point: str | None = None,
                 module: str | None = None, version: str = "0.1", requires: tuple[str, ...] = (),
                 subdir: str = "") -> Path:
        """Write distribution ``dist`` whose ``qplug`` entry point ``entry_point`` names ``module``.

        ``source`` is the module's code (``None``: the module does not exist). ``subdir`` puts the
        distribution on a separate ``sys.path`` entry (for two copies of one distribution).
        """
        module = module or dist.replace("-", "_")
        entry_point = entry_point or dist.removeprefix("qplug-")
        root = self.root / subdir if subdir else self.root
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        metadata = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {line}" for line in requires]
        (info / "METADATA").write_text("\n".join(metadata) + "\n")
        (info / "entry_points.txt").write_text(f"[qplug]\n{entry_point} = {module}\n")
        if source is not None:
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        if str(root) not in sys.path:
            self.monkeypatch.syspath_prepend(root)
        self.dists.append(dist)
        self.monkeypatch.setenv(plugins.ENV_LOAD, ",".join(self.dists))
        importlib.invalidate_caches()
        plugins.reset()
        return root

    def forget_modules(self) -> None:
        """Drop the fake plugin modules from ``sys.modules`` (fixture teardown)."""
        for module in self.modules:
            sys.modules.pop(module, None)


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDists]:
    """Import this fixture into a ``conftest.py`` to write fake distributions in ``tmp_path``."""
    dists = FakeDists(tmp_path, monkeypatch)
    yield dists
    dists.forget_modules()


__all__ = ["FakeDists", "fake_dist"]

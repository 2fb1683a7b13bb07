"""Fixtures of the fault-injection suite (issue 9).

Nothing here is autouse, so that every test file in this directory chooses what it needs: the
project-wide conftest loads only the built-in ``reference`` plugin, and the flow tests opt in to the
installed fbgemm and qnnpack plugins with ``pytestmark = pytest.mark.usefixtures("installed_backends")``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable, Iterator

import pytest

from qplug_core.registry import plugins

__all__ = ["installed_backends", "register_plugin"]

BACKEND_DISTRIBUTIONS = {"fbgemm": "qplug-fbgemm", "qnnpack": "qplug-qnnpack"}


@pytest.fixture
def installed_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Load the installed fbgemm and qnnpack plugins (and nothing else discoverable)."""
    for dist in BACKEND_DISTRIBUTIONS.values():
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (pip install -e plugins/{dist.replace('-', '_')})")
    monkeypatch.setenv(plugins.ENV_LOAD, ",".join(BACKEND_DISTRIBUTIONS))
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def register_plugin(installed_backends: None) -> Callable[[object, str], plugins.PluginRecord]:
    """Register a class-based fake plugin on the current manager (tier 1 of the plugin tests).

    The manager has no public API for objects that do not come from an entry point, so this is the
    one place that touches its records; backends assembled before are rebuilt.
    """
    manager = plugins.get_manager()

    def register(plugin: object, name: str) -> plugins.PluginRecord:
        record = plugins.PluginRecord(name, f"qplug-{name}", "0.1", module=f"{name}_plugin")
        manager.records.append(record)
        manager._by_name[name] = record
        manager.pm.register(plugin, name=name)
        manager.cache.clear()
        return record

    return register

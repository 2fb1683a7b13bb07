"""Project-wide test setup: plugin loading under the tests' control, and hypothesis profiles.

By default a test sees only the core's built-in plugins (``QPLUG_LOAD_PLUGINS=''``, as llm and
datasette do), whatever happens to be installed, and starts from a fresh plugin manager. Tests that
exercise discovery use the ``plugin_autoload`` fixture.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
from hypothesis import settings

from qplug_core import testing
from qplug_core.registry import plugins

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("nightly", max_examples=50_000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_PLUGIN_SWITCHES = (plugins.ENV_DISABLE, plugins.ENV_STRICT, plugins.ENV_TRACE, "QPLUG_DEBUG")


@pytest.fixture(autouse=True)
def _builtin_plugins_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(plugins.ENV_LOAD, "")
    for name in _PLUGIN_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")`` (model-sized tests)."""
    with testing.one_thread():
        yield


@pytest.fixture
def plugin_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load every installed / discoverable ``qplug`` entry point, as outside the tests."""
    monkeypatch.delenv(plugins.ENV_LOAD, raising=False)
    plugins.reset()

"""Load only this plugin (and the core's built-in reference backend), whatever else is installed."""

import pytest

from qplug_core import plugins


@pytest.fixture(autouse=True)
def only_this_plugin(monkeypatch):
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-tiny")
    for name in (plugins.ENV_DISABLE, plugins.ENV_STRICT):
        monkeypatch.delenv(name, raising=False)
    plugins.reset()
    yield
    plugins.reset()

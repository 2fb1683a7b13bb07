"""qplug's pytest plugin (entry point ``pytest11: qplug``): fixtures for testing backend plugins.

Installed with qplug-core, so a plugin's test suite gets them without a conftest:

* ``qplug_only(*names)``: load only these plugins (entry-point or distribution names) and the
  core's built-in ones, on a fresh plugin manager; no names loads every installed plugin. Returns
  a :class:`PluginSession` to look at records and call hooks the way the core does.
* ``fake_dist``: write a discoverable distribution (dist-info with an entry point) into
  ``tmp_path`` and load it alone (:class:`qplug_core.testing.dists.FakeDists`).

It registers the markers the kit uses (``slow``), so ``pytest --strict-markers`` accepts them.
And one rule for CI: with ``QPLUG_REQUIRE_ALL=1`` a test skipped because something is missing
(a distribution, a module, a backend this machine cannot run) fails instead, so that a broken
environment cannot pass as green. This module imports only pytest until a fixture is used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from qplug_core.registry.plugins import HookResult, PluginRecord
    from qplug_core.testing.dists import FakeDists

ENV_REQUIRE_ALL = "QPLUG_REQUIRE_ALL"
#: skip reasons that mean "something is missing here", not "this case does not apply"
MISSING = re.compile(r"not installed|could not import|no module named|unavailable|"
                     r"cannot run on this machine", re.I)


class PluginSession:
    """The plugins one ``qplug_only`` call loaded, seen as the core sees them."""

    def records(self) -> list[PluginRecord]:
        from qplug_core.registry import plugins

        return plugins.plugin_records()

    def record(self, name: str) -> PluginRecord:
        """The record of plugin ``name`` (entry-point name); fails the test if it was not seen."""
        found = [r for r in self.records() if r.name == name]
        if not found:
            pytest.fail(f"no plugin {name!r} was seen; seen: {[r.name for r in self.records()]}")
        return found[0]

    def collect(self, hook: str, *, plugin: str | None = None, **kwargs: Any) -> list[HookResult]:
        """Call ``hook`` as the core does (each implementation isolated, return type-checked);
        ``plugin`` keeps only that plugin's results."""
        from qplug_core.registry import plugins

        results = plugins.collect(hook, **kwargs)
        return [r for r in results if plugin is None or r.record.name == plugin]


@pytest.fixture
def qplug_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., PluginSession]]:
    from qplug_core.registry import plugins

    def load(*names: str) -> PluginSession:
        if names:
            monkeypatch.setenv(plugins.ENV_LOAD, ",".join(names))
        else:
            monkeypatch.delenv(plugins.ENV_LOAD, raising=False)
        for switch in (plugins.ENV_DISABLE, plugins.ENV_STRICT):
            monkeypatch.delenv(switch, raising=False)
        plugins.reset()
        return PluginSession()

    yield load
    plugins.reset()


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDists]:
    from qplug_core.registry import plugins
    from qplug_core.testing.dists import FakeDists

    dists = FakeDists(tmp_path, monkeypatch)
    yield dists
    dists.forget_modules()
    plugins.reset()


#: markers the testing kit puts on tests (the pattern suite marks its long cases ``slow``)
MARKERS = ("slow: long end-to-end case (qplug's pattern suite marks its ATen-level cases); "
           "deselect with -m 'not slow'",)


def pytest_configure(config: pytest.Config) -> None:
    """Register the kit's markers, so a plugin's suite runs clean under ``--strict-markers``."""
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if os.environ.get(ENV_REQUIRE_ALL) == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if MISSING.search(reason):
            report.outcome = "failed"
            report.longrepr = (f"{ENV_REQUIRE_ALL}=1: skipped because something is missing, which "
                               f"CI does not allow: {reason}")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module-level skip (``require_distribution``) is a collection report, not a test's."""
    report = yield
    if os.environ.get(ENV_REQUIRE_ALL) == "1" and report.skipped:
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if MISSING.search(reason):
            report.outcome = "failed"
            report.longrepr = f"{ENV_REQUIRE_ALL}=1: {report.nodeid} skipped: {reason}"
    return report


__all__ = ["ENV_REQUIRE_ALL", "PluginSession", "fake_dist", "qplug_only"]

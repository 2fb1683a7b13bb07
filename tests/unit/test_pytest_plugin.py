"""qplug's pytest plugin (``pytest11: qplug``): it is installed, and QPLUG_REQUIRE_ALL=1 turns skips
for something missing into failures while other skips stay skips."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

SUITE = textwrap.dedent('''
    import pytest

    def test_needs_a_distribution():
        pytest.skip("qplug-nosuch is not installed (pip install it to run these tests)")

    def test_needs_a_module():
        pytest.importorskip("qplug_no_such_module")

    def test_does_not_apply_here():
        pytest.skip("this pattern is dead config, nothing to check")

    def test_passes(qplug_only):
        session = qplug_only()
        assert session.record("reference").status == "ok"
''')


def run(tmp_path, require_all: bool) -> str:
    (tmp_path / "test_sample.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    if require_all:
        env["QPLUG_REQUIRE_ALL"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                             str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    return result.stdout


def test_the_plugin_is_registered_by_the_core_distribution():
    # every qplug-core metadata on the path (a stale egg-info in a checkout may shadow the installed
    # one for entry_points(), but pytest loads plugins from all of them)
    found = {ep.value for dist in importlib.metadata.distributions() if dist.name == "qplug-core"
             for ep in dist.entry_points if ep.group == "pytest11" and ep.name == "qplug"}
    assert found == {"qplug_core.testing.pytest_plugin"}


@pytest.mark.parametrize("require_all, summary", [(False, "1 passed, 3 skipped"),
                                                  (True, "2 failed, 1 passed, 1 skipped")])
def test_require_all_fails_skips_for_missing_things(tmp_path, require_all, summary):
    output = run(tmp_path, require_all)
    assert summary in output, output[-2000:]
    if require_all:
        assert "FAILED test_sample.py::test_needs_a_distribution" in output
        assert "FAILED test_sample.py::test_needs_a_module" in output
        assert "SKIPPED" in output and "dead config" in output


def test_loading_the_plugin_imports_neither_torch_nor_the_pipeline():
    """pytest loads the plugin in every test session of an environment with qplug-core installed:
    a project that never uses qplug must not pay torch's import for it."""
    code = ("import sys, qplug_core.testing.pytest_plugin, qplug_core.testing as kit\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('qplug_core.')))\n"
            "kit.check_pattern\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = result.stdout.splitlines()
    assert first == "['qplug_core.testing', 'qplug_core.testing.pytest_plugin']"
    assert second == "True"  # the kit's names still load on use

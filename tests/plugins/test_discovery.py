"""Discovery and fault isolation with real (fake) distributions: reliability rows B5 1-12, 40, G10."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qplug_core.cli.app import app
from qplug_core.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    DuplicateBackendError,
    DuplicatePatternError,
    PluginContractError,
    PluginHookError,
    PluginLoadError,
)
from qplug_core.registry import plugins
from qplug_core.registry.backends import get_backend, list_backends

REPO = Path(__file__).resolve().parents[2]

HEADER = """
from qplug_core.registry.backends import BackendSpec, engine_availability
from qplug_core.registry.hookspecs import hookimpl
"""


def registers(backend: str, engine: str | None = None) -> str:
    availability = f", engine={engine!r}, is_available=lambda: engine_availability({engine!r})" \
        if engine else ""
    return HEADER + f"""
@hookimpl
def qplug_register_backends():
    return [BackendSpec({backend!r}, "fake backend"{availability})]
"""


def adds_pattern(backend: str) -> str:
    return HEADER + f"""
@hookimpl
def qplug_backend_pattern_configs(backend):
    from torch import nn
    from qplug_core.config import BackendPatternConfig
    return [BackendPatternConfig(nn.Softsign)] if backend == {backend!r} else []
"""


RAISING_HOOK = HEADER + """
@hookimpl
def qplug_register_backends():
    raise RuntimeError("hook exploded")
"""


def returns(value: str) -> str:
    return HEADER + f"""
@hookimpl
def qplug_register_backends():
    return {value}
"""


def record(name: str) -> plugins.PluginRecord:
    return next(r for r in plugins.plugin_records() if r.name == name)


def backend_names() -> list[str]:
    return [info.name for info in list_backends()]


def run_cli(*args: str, pythonpath: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(pythonpath), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "qplug_core.cli.app", *args], capture_output=True,
                          text=True, env=environ, cwd=pythonpath, timeout=60)


# -- a good third-party plugin ---------------------------------------------------------------------


def test_third_party_backend_is_assembled_and_listed(fake_dist):
    fake_dist("qplug-acme", registers("acme") + adds_pattern("acme").replace(HEADER, ""))
    info = next(i for i in list_backends() if i.name == "acme")
    assert (info.status, info.n_pattern_configs, info.n_kernels) == ("ok", 1, 0)
    assert [(r.dist, r.version) for r in info.contributors] == [("qplug-acme", "0.1")]
    backend = get_backend("acme")
    assert backend.require_available() is backend
    assert record("acme").status is plugins.PluginStatus.OK


def test_third_party_backend_in_cli_json(fake_dist):
    fake_dist("qplug-acme", registers("acme"))
    result = CliRunner().invoke(app, ["list-backends", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["schema_version"] == 1
    acme = next(b for b in document["backends"] if b["name"] == "acme")
    assert acme["plugins"] == [{"name": "acme", "dist": "qplug-acme", "version": "0.1"}]
    assert {"reference", "acme"} <= {b["name"] for b in document["backends"]}


# -- broken plugins are isolated -------------------------------------------------------------------


@pytest.mark.parametrize("source, cause", [
    (None, "ModuleNotFoundError"),
    ("raise ImportError('needs libfoo')", "ImportError: needs libfoo"),
    ("raise RuntimeError('bad init')", "RuntimeError: bad init"),
    ("raise SystemExit(1)", "SystemExit: 1"),
], ids=["missing-module", "import-error", "runtime-error", "system-exit"])
def test_plugin_failing_at_import_is_skipped(fake_dist, source, cause):
    fake_dist("qplug-bad", source)
    fake_dist("qplug-acme", registers("acme"))
    with pytest.warns(plugins.QplugPluginWarning) as caught:
        assert "acme" in backend_names()
    bad = record("bad")
    assert bad.status is plugins.PluginStatus.BROKEN
    assert isinstance(bad.error, PluginLoadError)
    assert (bad.error.plugin, bad.error.dist, bad.error.version) == ("bad", "qplug-bad", "0.1")
    assert f"plugin 'bad' (qplug-bad 0.1) failed to load: {cause}" in str(bad.error)
    assert str(bad.error).endswith("disable with QPLUG_DISABLE_PLUGINS=bad")
    assert [str(w.message) for w in caught] == [str(bad.error)]


def test_keyboard_interrupt_at_import_is_not_swallowed(fake_dist):
    fake_dist("qplug-bad", "raise KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt):
        plugins.get_manager()


def test_raising_hook_is_attributed_and_others_still_work(fake_dist):
    fake_dist("qplug-boom", RAISING_HOOK)
    fake_dist("qplug-acme", registers("acme"))
    with pytest.warns(plugins.QplugPluginWarning, match="hook qplug_register_backends raised "
                                                        "RuntimeError: hook exploded"):
        assert {"reference", "acme"} <= set(backend_names())
    error = record("boom").error
    assert isinstance(error, PluginHookError)
    assert (error.plugin, error.dist, error.hook) == ("boom", "qplug-boom", "qplug_register_backends")
    assert isinstance(error.__cause__, RuntimeError)


def test_hook_failing_for_one_backend_marks_only_that_backend_broken(fake_dist):
    fake_dist("qplug-flaky", registers("flaky") + """
@hookimpl
def qplug_backend_pattern_configs(backend):
    if backend == "flaky":
        raise ValueError("no configs today")
    return []
""")
    with pytest.warns(plugins.QplugPluginWarning, match="no configs today"):
        status = {info.name: info.status for info in list_backends()}
    assert status["flaky"] == "broken" and status["reference"] == "ok"
    with pytest.raises(BackendUnavailableError, match="backend 'flaky' is broken: .*no configs today") as raised:
        get_backend("flaky")
    assert raised.value.__cause__.hook == "qplug_backend_pattern_configs"


@pytest.mark.parametrize("value, actual", [
    ("None", "NoneType"), ("{'acme': 1}", "dict[str, int]"), ("['acme']", "list[str]"),
])
def test_wrong_return_type_is_a_contract_error(fake_dist, value, actual):
    fake_dist("qplug-garbage", returns(value))
    with pytest.warns(plugins.QplugPluginWarning):
        names = backend_names()
    assert names == ["reference"]
    error = record("garbage").error
    assert isinstance(error, PluginContractError)
    assert f"must return list[BackendSpec], got {actual}" in str(error)


def test_misspelled_hook_argument_fails_validation(fake_dist):
    fake_dist("qplug-typo", HEADER + """
@hookimpl
def qplug_backend_pattern_configs(backnd):
    return []
""")
    fake_dist("qplug-acme", registers("acme"))
    with pytest.warns(plugins.QplugPluginWarning, match="backnd"):
        assert "acme" in backend_names()
    assert record("typo").status is plugins.PluginStatus.BROKEN
    assert "PluginValidationError" in str(record("typo").error)
    assert "typo" not in dict(plugins.get_manager().pm.list_name_plugin())


def test_unknown_hook_name_fails_validation(fake_dist):
    fake_dist("qplug-typo", registers("typo") + """
@hookimpl
def qplug_register_backend():
    return []
""")
    with pytest.warns(plugins.QplugPluginWarning, match="unknown hook.*qplug_register_backend"):
        assert backend_names() == ["reference"]


# -- conflicts -------------------------------------------------------------------------------------


def test_backend_registered_by_two_distributions_is_a_conflict(fake_dist):
    fake_dist("qplug-one", registers("twin"))
    fake_dist("qplug-two", registers("twin"))
    rows = [(i.name, i.status, i.contributors[0].dist) for i in list_backends() if i.name == "twin"]
    assert rows == [("twin", "conflict", "qplug-one"), ("twin", "conflict", "qplug-two")]
    with pytest.raises(DuplicateBackendError, match="qplug-one 0.1.*qplug-two 0.1") as raised:
        get_backend("twin")
    assert raised.value.dists == ("qplug-one", "qplug-two")


def test_same_pattern_from_two_plugins_names_both(fake_dist):
    fake_dist("qplug-left", adds_pattern("reference"))
    fake_dist("qplug-right", adds_pattern("reference"))
    with pytest.raises(DuplicatePatternError) as raised:
        get_backend("reference")
    assert "'left' (qplug-left 0.1)" in str(raised.value)
    assert "'right' (qplug-right 0.1)" in str(raised.value)
    assert next(i for i in list_backends() if i.name == "reference").status == "broken"


def test_same_entry_point_name_from_two_distributions_keeps_the_first(fake_dist):
    fake_dist("qplug-acme", registers("acme"), module="acme_wheel", version="0.1", subdir="wheel")
    fake_dist("qplug-acme", registers("acme"), version="0.2", subdir="editable")  # first on sys.path
    with pytest.warns(plugins.QplugPluginWarning, match="already taken by qplug-acme 0.2 .kept."):
        info = next(i for i in list_backends() if i.name == "acme")
    assert info.status == "ok" and info.contributors[0].version == "0.2"
    assert [r.status.value for r in plugins.plugin_records() if r.name == "acme"] == ["ok", "conflict"]


def test_incompatible_core_is_skipped_before_import(fake_dist):
    version = plugins.core_version()
    if version is None:
        pytest.skip("qplug-core is not installed (pip install -e .): no version to check against")
    fake_dist("qplug-future", registers("future"), requires=("qplug-core>=2", "torch>=2.4"))
    with pytest.warns(plugins.QplugPluginWarning, match=f"requires qplug-core>=2, found {version}"):
        assert "future" not in backend_names()
    assert record("future").status is plugins.PluginStatus.INCOMPATIBLE
    assert "qplug_future" not in sys.modules


# -- environment switches --------------------------------------------------------------------------


def test_load_plugins_selects_by_entry_point_or_distribution_name(fake_dist, monkeypatch):
    fake_dist("qplug-acme", registers("acme"))
    fake_dist("qplug-other", registers("other"))
    monkeypatch.setenv(plugins.ENV_LOAD, "")
    plugins.reset()
    assert backend_names() == ["reference"] and "qplug_acme" not in sys.modules
    monkeypatch.setenv(plugins.ENV_LOAD, "acme, qplug-other")
    plugins.reset()
    assert sorted(backend_names()) == ["acme", "other", "reference"]


def test_load_plugins_naming_a_missing_plugin_warns_and_exits_0(fake_dist, monkeypatch):
    fake_dist("qplug-acme", registers("acme"))
    monkeypatch.setenv(plugins.ENV_LOAD, "acme,nope")
    result = CliRunner().invoke(app, ["list-backends"])
    assert result.exit_code == 0
    assert "qplug: plugin 'nope' could not be found" in result.stderr
    assert "acme" in result.stdout


def test_disable_plugins_never_imports(fake_dist, monkeypatch):
    fake_dist("qplug-acme", registers("acme"))
    monkeypatch.setenv(plugins.ENV_DISABLE, "acme")
    assert "acme" not in backend_names()
    assert record("acme").status is plugins.PluginStatus.DISABLED
    assert "qplug_acme" not in sys.modules
    with pytest.raises(BackendNotFoundError, match="plugin 'acme' .qplug-acme 0.1. is disabled"):
        get_backend("acme")


def test_strict_mode(fake_dist, monkeypatch):
    fake_dist("qplug-bad", "raise ImportError('needs libfoo')")
    runner = CliRunner()
    flagged = runner.invoke(app, ["list-backends", "--strict"])
    assert flagged.exit_code == 3 and "broken: plugin 'bad'" in flagged.stdout
    assert flagged.stderr.startswith("qplug: plugin 'bad' (qplug-bad 0.1) failed to load")
    monkeypatch.setenv(plugins.ENV_STRICT, "1")
    plugins.reset()
    with pytest.raises(PluginLoadError, match="needs libfoo"):
        plugins.get_manager()
    plugins.reset()
    env_strict = runner.invoke(app, ["list-backends"])
    assert env_strict.exit_code == 3
    assert env_strict.stderr.startswith("qplug: error: plugin 'bad' (qplug-bad 0.1) failed to load")


def test_no_load_reads_metadata_only(fake_dist):
    fake_dist("qplug-acme", registers("acme"))
    result = CliRunner().invoke(app, ["list-backends", "--no-load", "--json"])
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["loaded"] is False
    assert {"name": "acme", "status": "ok"}.items() <= next(
        p for p in document["plugins"] if p["name"] == "acme").items()
    assert "qplug_acme" not in sys.modules


def test_trace_hooks(fake_dist, monkeypatch, capsys):
    fake_dist("qplug-acme", registers("acme"))
    monkeypatch.setenv(plugins.ENV_TRACE, "1")
    plugins.reset()
    plugins.collect("qplug_register_backends")
    assert "qplug: trace qplug_register_backends({}) by 'acme' (qplug-acme 0.1) -> " \
           "list[BackendSpec]" in capsys.readouterr().err


# -- backend selection -----------------------------------------------------------------------------


def test_unavailable_engine(fake_dist):
    fake_dist("qplug-exotic", registers("exotic", engine="nosuchengine"))
    info = next(i for i in list_backends() if i.name == "exotic")
    assert info.status == "unavailable" and "'nosuchengine' not in torch.backends" in info.reason
    with pytest.raises(BackendUnavailableError, match="backend 'exotic' cannot run on this machine"):
        get_backend("exotic").require_available()


def test_unknown_backend_suggests_a_name():
    with pytest.raises(BackendNotFoundError, match="did you mean 'reference'.*installed backends: "
                                                   "reference"):
        get_backend("referense")


def test_a_plugin_can_choose_the_default_backend(fake_dist):
    fake_dist("qplug-acme", registers("acme") + """
@hookimpl
def qplug_select_default_backend(available):
    return "acme" if "acme" in available else None
""")
    assert get_backend().name == "acme"


# -- G10, through a real subprocess ----------------------------------------------------------------


def test_g10_three_broken_two_good_plugins(fake_dist, tmp_path):
    fake_dist("qplug-good1", registers("good1"))
    fake_dist("qplug-good2", registers("good2"))
    fake_dist("qplug-bad-import", "import qplug_no_such_module")
    fake_dist("qplug-bad-hook", RAISING_HOOK)
    fake_dist("qplug-bad-type", returns("{'x': 1}"))
    result = run_cli("list-backends", "--json", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    fakes = {p["name"]: p["status"] for p in document["plugins"] if p["name"].startswith(("good", "bad"))}
    assert sorted(fakes.values()) == ["broken"] * 3 + ["ok"] * 2
    assert {"good1", "good2"} <= {b["name"] for b in document["backends"] if b["status"] == "ok"}
    stderr = result.stderr.splitlines()
    assert len(stderr) <= 3
    assert all(line.startswith("qplug: plugin 'bad-") for line in stderr)

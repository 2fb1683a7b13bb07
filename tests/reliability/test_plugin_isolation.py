"""Plugins misbehaving at import or in a hook, measured with real (fake) distributions: nothing they
print reaches stdout, ``sys.exit`` or ``qp.list_backends()`` at import only breaks that plugin, their
warning filters and quantized engine do not leak, and slow imports are timed and named (issue 17)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qplug_core as qp
from qplug_core.cli.app import app
from qplug_core.errors import PluginLoadError
from qplug_core.registry import plugins

REPO = Path(__file__).resolve().parents[2]

HEADER = """
from qplug_core.registry.backends import BackendSpec
from qplug_core.registry.hookspecs import hookimpl
"""


def registers(backend: str, *, at_import: str = "", in_hook: str = "") -> str:
    """A plugin registering ``backend``; ``at_import`` / ``in_hook`` are statements it also runs."""
    return HEADER + f"""
{at_import}

@hookimpl
def qplug_register_backends():
    {in_hook or 'pass'}
    return [BackendSpec({backend!r}, "fake backend")]
"""


def record(name: str) -> plugins.PluginRecord:
    return next(r for r in plugins.plugin_records() if r.name == name)


def statuses() -> dict[str, str]:
    return {info.name: info.status for info in qp.list_backends()}


def run_qplug(*args: str, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    """The real command in a fresh process, seeing the fake distributions under ``pythonpath``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    environ.update(PYTHONPATH=os.pathsep.join([str(pythonpath), str(REPO)]),
                   QPLUG_LOAD_PLUGINS=os.environ[plugins.ENV_LOAD])
    return subprocess.run([sys.executable, "-m", "qplug_core.cli.app", *args], capture_output=True,
                          text=True, env=environ, cwd=pythonpath, timeout=120)


def test_plugin_stdout_at_import_and_in_hooks_does_not_corrupt_json(fake_dist, tmp_path):
    fake_dist("qplug-chatty", registers("chatty", at_import="print('chatty: importing')",
                                        in_hook="print('chatty: registering')"))
    fake_dist("qplug-quitter", registers("quitter", in_hook="import sys; sys.exit(0)"))
    result = run_qplug("list-backends", "--json", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # nothing but the document on stdout
    rows = {b["name"]: b["status"] for b in document["backends"]}
    assert rows["chatty"] == "ok" and rows["reference"] == "ok"
    assert "chatty: importing" in result.stderr and "chatty: registering" in result.stderr
    # sys.exit(0) in a hook is a broken plugin, not a silent exit of the command
    quitter = next(p for p in document["plugins"] if p["name"] == "quitter")
    assert quitter["status"] == "broken"
    assert "hook qplug_register_backends raised SystemExit: 0" in quitter["error"]
    assert "qplug: plugin 'quitter' (qplug-quitter 0.1): hook qplug_register_backends raised " \
           "SystemExit" in result.stderr
    assert "Traceback" not in result.stderr


def test_plugin_calling_list_backends_while_imported_gets_a_clear_error(fake_dist):
    fake_dist("qplug-eager", registers("eager", at_import="import qplug_core\nqplug_core.list_backends()"))
    fake_dist("qplug-acme", registers("acme"))
    with pytest.warns(plugins.QplugPluginWarning, match="plugin 'eager' .qplug-eager 0.1. failed to load: "
                                                        "PluginLoadError: qplug's API was called while "
                                                        "qplug is loading its plugins"):
        rows = statuses()
    assert rows == {"reference": "ok", "acme": "ok"}  # the others still load, nothing half-built
    assert record("eager").status is plugins.PluginStatus.BROKEN
    assert isinstance(record("eager").error, PluginLoadError)
    assert "call it later" in str(record("eager").error)


def test_plugin_calling_list_backends_from_a_hook_breaks_only_itself(fake_dist):
    fake_dist("qplug-nosy", registers("nosy", in_hook="import qplug_core; qplug_core.list_backends()"))
    fake_dist("qplug-acme", registers("acme"))
    with pytest.warns(plugins.QplugPluginWarning, match="'nosy'.*qplug_register_backends raised "
                                                        "PluginHookError: qplug's API was called while "
                                                        "qplug is assembling its backends"):
        rows = statuses()
    assert rows == {"reference": "ok", "acme": "ok"}


def test_error_filter_set_by_one_plugin_does_not_turn_another_failure_into_a_traceback(fake_dist):
    fake_dist("qplug-broken", "raise ImportError('needs libfoo')")
    # a later sys.path entry is searched first: the strict plugin is imported before the broken one
    fake_dist("qplug-strict", registers("strict", at_import="import warnings\n"
                                        "warnings.simplefilter('error')"), subdir="first")
    filters = list(warnings.filters)
    with pytest.warns(plugins.QplugPluginWarning, match="'broken'.*failed to load: ImportError: needs libfoo"):
        rows = statuses()
    assert [r.name for r in plugins.plugin_records() if not r.builtin] == ["strict", "broken"]
    assert rows == {"reference": "ok", "strict": "ok"}
    assert record("broken").status is plugins.PluginStatus.BROKEN
    assert warnings.filters == filters  # the plugin's filter did not outlive its import


def test_plugin_changing_the_quantized_engine_at_import_is_undone_and_named(fake_dist):
    before = torch.backends.quantized.engine
    other = next(e for e in torch.backends.quantized.supported_engines if e not in (before, "none"))
    fake_dist("qplug-switcher", registers(
        "switcher", at_import=f"import torch\ntorch.backends.quantized.engine = {other!r}"))
    with pytest.warns(plugins.QplugPluginWarning, match=f"plugin 'switcher' .qplug-switcher 0.1. set "
                                                        f"torch.backends.quantized.engine to '{other}' "
                                                        f"while being imported; qplug restored '{before}'"):
        rows = statuses()
    assert torch.backends.quantized.engine == before
    assert rows["switcher"] == "ok"  # the plugin still works; only its side effect is undone


def test_slow_plugin_import_is_timed_and_named(fake_dist):
    fake_dist("qplug-sloth", registers("sloth", at_import="import time\ntime.sleep(2.2)"))
    fake_dist("qplug-acme", registers("acme"))
    result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    slow = [line for line in result.stderr.splitlines() if "to import" in line]
    assert len(slow) == 1 and slow[0].startswith("qplug: plugin 'sloth' (qplug-sloth 0.1) took 2.")
    assert "more than 2 s" in slow[0] and "QPLUG_DISABLE_PLUGINS=sloth" in slow[0]
    times = {p["name"]: p["load_seconds"] for p in json.loads(result.stdout)["plugins"]}
    assert times["sloth"] >= 2.2
    assert 0 <= times["acme"] < 2.2 and times["reference"] is not None
    table = CliRunner().invoke(app, ["plugins"], env={"COLUMNS": "200"})
    assert "load time" in table.stdout and "s " in table.stdout


def test_the_first_plugin_is_not_charged_for_importing_qplugs_plugin_api(fake_dist, tmp_path):
    """Every plugin imports qplug_core.plugin_api (~2.5 s, most of qplug): the first one to load
    was timed with it, and named as slow on a busy machine (qnnpack: "took 4.5 s to import")."""
    fake_dist("qplug-early", registers(
        "early", at_import="import sys\nprint('api before plugin:', 'qplug_core.plugin_api' in sys.modules)"))
    result = run_qplug("plugins", "--json", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "api before plugin: True" in result.stderr


NATIVE_WRITE = "import os; os.write(1, b'native: {}\\n')"
PRINTF = "import ctypes; ctypes.CDLL(None).printf(b'printf: {}\\n')"


@pytest.mark.parametrize("command", [["list-backends", "--json"], ["doctor", "--json"]])
def test_plugin_output_below_sys_stdout_does_not_corrupt_json(fake_dist, tmp_path, command):
    """A native library writes to file descriptor 1 directly (issue 27, finding 7)."""
    fake_dist("qplug-native", registers("native", at_import=NATIVE_WRITE.format("importing"),
                                        in_hook=PRINTF.format("registering")))
    result = run_qplug(*command, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)  # nothing but the document on stdout
    assert "native: importing" in result.stderr and "printf: registering" in result.stderr


def test_os_exit_in_a_hook_is_a_broken_plugin_named_with_its_hook(fake_dist, tmp_path):
    fake_dist("qplug-killer", registers("killer", in_hook="import os; os._exit(0)"))
    result = run_qplug("list-backends", "--json", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    killer = next(p for p in document["plugins"] if p["name"] == "killer")
    assert killer["status"] == "broken"
    assert "hook qplug_register_backends raised HardExit: os._exit(0) was called" in killer["error"]
    assert {b["name"]: b["status"] for b in document["backends"]}["reference"] == "ok"


def test_a_plugins_error_text_reaches_the_terminal_escaped(fake_dist, tmp_path):
    """Its error is printed in the listing and as a warning: no escape sequence gets through."""
    fake_dist("qplug-rogue", registers("rogue", in_hook="raise RuntimeError('\\x1b]0;pwned\\x07\\x1b[2J')"))
    result = run_qplug("list-backends", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    assert "raised RuntimeError: \\x1b]0;pwned\\x07\\x1b[2J" in result.stdout

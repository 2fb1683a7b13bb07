"""The ``qplug`` command line with only the built-in plugins (discovery lives in tests/plugins)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qplug_core.cli.app import app
from qplug_core.kernels.pair_sums_probe import PAIRS_SATURATE, probe_pair_sums, torch_engine_gemm

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_version_option_and_command_agree():
    option, command = runner.invoke(app, ["--version"]), runner.invoke(app, ["version"])
    assert option.exit_code == command.exit_code == 0
    assert option.stdout == command.stdout
    assert option.stdout.startswith("qplug-core ")


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "list-backends" in result.output and result.exit_code in (0, 2)


def test_list_backends_table_shows_reference():
    result = runner.invoke(app, ["list-backends"])
    assert result.exit_code == 0
    assert "reference" in result.stdout and "qplug-core" in result.stdout


def test_list_backends_json_schema():
    result = runner.invoke(app, ["list-backends", "--json"])
    document = json.loads(result.stdout)
    assert set(document) == {"schema_version", "loaded", "backends", "plugins"}
    (reference,) = document["backends"]
    assert reference["name"] == "reference" and reference["status"] == "ok"
    assert reference["n_kernels"] == 0 and reference["n_pattern_configs"] > 0
    assert set(reference) == {"name", "status", "available", "reason", "description", "engine",
                              "plugins", "n_pattern_configs", "n_kernels"}


def test_plugins_json_lists_the_builtin_reference():
    document = json.loads(runner.invoke(app, ["plugins", "--json"]).stdout)
    assert document["plugins"][0]["name"] == "reference" and document["plugins"][0]["builtin"]


def test_doctor_reports_torch_and_backends():
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0
    assert "[ok] torch: torch " in result.stdout
    assert "[ok] backend reference: ok" in result.stdout


WITHOUT_VNNI = ("no VNNI on this CPU: its kernels sum u8 x s8 pairs in int16 with saturation. With the "
                "default qconfig each layer keeps 8-bit weights where no pair sum saturates on the "
                "example and calibration data (or saturation changes at most 0.1% of its outputs "
                "there and costs less than a bit) and gets 7-bit ones elsewhere")
SLOWER = "Int8 is at most ~1.9x fp32 per core here, and accuracy targets fall back to "
KERNEL_FALLBACKS = "per-token dynamic int8 (oneDNN's GEMM, 7-bit weights), per-tensor dynamic int8 or float"
COMPILED_FALLBACKS = ("per-tensor dynamic int8 or float (a per-token layer cannot run inside a compiled "
                      "partition)")


@pytest.mark.parametrize("flags, cpu, fbgemm, onnxruntime", [
    ("avx2 fma", "AVX2 without VNNI",
     [f"[warning] backend fbgemm: {WITHOUT_VNNI}", "; a kernel that still breaks the contract runs "
      "the reference form (slow). " + SLOWER + KERNEL_FALLBACKS],
     [f"[warning] backend onnxruntime: {WITHOUT_VNNI}", "; a compiled partition that still breaks "
      "the contract is compiled again with 7-bit weights, else runs the reference form (slow). "
      + SLOWER + COMPILED_FALLBACKS]),
    ("avx2 avx512f avx512bw avx512_vnni", "AVX-512 + VNNI",
     ["[{fbgemm}] backend fbgemm: VNNI on this CPU: full 8-bit operands"],
     ["[{onnxruntime}] backend onnxruntime: VNNI on this CPU: full 8-bit operands"]),
])
def test_doctor_says_what_the_cpu_means_per_backend(qplug_only, monkeypatch, flags, cpu, fbgemm,
                                                    onnxruntime):
    """The findings follow the (overridden) flags; each also says what a worst-case probe on the
    backend's real kernels did on this host, and warns where they saturate against the flags."""
    from qplug_onnxruntime.probe import matmul_integer

    probes = {"fbgemm": probe_pair_sums(torch_engine_gemm("fbgemm")), "onnxruntime": probe_pair_sums(matmul_integer)}
    levels = {name: "warning" if result == PAIRS_SATURATE else "ok" for name, result in probes.items()}
    fbgemm, onnxruntime = ([part.format(**levels) for part in parts] for parts in (fbgemm, onnxruntime))
    qplug_only("qplug-fbgemm", "qplug-qnnpack", "qplug-onnxruntime")
    monkeypatch.setenv("QPLUG_CPU_FLAGS", flags)
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())  # doctor wraps its lines to the terminal's width
    assert f"[ok] cpu: int8: {platform.machine().lower()}: {cpu}" in text
    assert all(part in text for part in fbgemm + onnxruntime)
    for name, result in probes.items():
        said = "saturated int16 pair sums" if result == PAIRS_SATURATE else "was exact"
        assert f"a worst-case probe on its kernels {said}" in text.split(f"backend {name}: ")[-1]
    assert "[ok] backend qnnpack: its kernels accumulate in int32" in text


def test_unknown_option_is_a_usage_error():
    assert runner.invoke(app, ["list-backends", "--jsn"]).exit_code == 2


def test_fast_paths_do_not_import_torch():
    code = ("import sys\nfrom qplug_core.cli.app import main\n"
            "for argv in (['--version'], ['list-backends', '--no-load']):\n"
            "    sys.argv = ['qplug', *argv]\n"
            "    try:\n        main()\n    except SystemExit as exit:\n        assert not exit.code\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("torch imported: False")


def test_a_plugin_warning_given_with_its_prefix_is_one_qplug_line(capsys):
    """``qplug report`` printed qp.load's plugin-version warning as ``qplug: qplug: ...``."""
    import warnings

    from qplug_core.cli.app import _qplug_warnings_on_stderr
    from qplug_core.registry.plugins import QplugPluginWarning

    with _qplug_warnings_on_stderr():
        warnings.warn("qplug: m.safetensors was converted with qplug-vnpu 0.1.0 but 0.2.0 is installed",
                      QplugPluginWarning, stacklevel=1)
    assert capsys.readouterr().err == ("qplug: m.safetensors was converted with qplug-vnpu 0.1.0 but 0.2.0 "
                                       "is installed\n")

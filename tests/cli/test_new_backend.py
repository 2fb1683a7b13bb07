"""``qplug new-backend``: the scaffolded plugin package is valid, discoverable, and, installed into
a throw-away venv, listed by ``qplug list-backends`` and able to quantize the demo model."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch
from cli_testkit import assert_one_line_error, invoke

import qplug_core as qp
from qplug_core.cli.new_backend import core_requirement
from qplug_core.plugin_api import override_cpu_flags
from qplug_core.testing.dists import child_venv, pip_install_into

NAME = "acme_npu"


@pytest.fixture
def scaffolded(tmp_path: Path) -> Path:
    result = invoke("new-backend", NAME, "--dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "qplug-acme-npu"
    assert result.stdout.split() == [str(root / p) for p in (
        "README.md", "pyproject.toml", "qplug_acme_npu/__init__.py", "qplug_acme_npu/plugin.py",
        "tests/test_plugin.py")]
    assert f"next: pip install -e {root} && qplug list-backends" in result.stderr
    return root


def test_next_step_names_the_local_path_not_an_index_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("new-backend", "acme")
    assert result.exit_code == 0, result.stderr
    assert "next: pip install -e ./qplug-acme && " in result.stderr


def test_pyproject_declares_the_entry_point(scaffolded):
    project = tomllib.loads((scaffolded / "pyproject.toml").read_text())["project"]
    assert project["name"] == "qplug-acme-npu"
    assert project["entry-points"]["qplug"] == {NAME: "qplug_acme_npu.plugin:plugin"}
    assert core_requirement(qp.__version__) in project["dependencies"]
    assert "{{" not in "".join(p.read_text() for p in scaffolded.rglob("*") if p.is_file())


def test_plugin_is_discovered_and_quantizes(scaffolded, fake_dist):
    """Installed the fake_dist way: a dist-info beside the package on sys.path."""
    fake_dist("qplug-acme-npu", module="qplug_acme_npu.plugin:plugin", entry_point=NAME,
              version="0.1.0", location=scaffolded)
    (row,) = [r for r in qp.list_backends() if r.name == NAME]
    assert row.status == "ok" and row.n_pattern_configs == 1 and row.engine == "fbgemm"
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    qmodel = qp.quantize(model, (x,), [x], backend=NAME, progress=False)
    assert qp.quantization_report(qmodel).kernels == {"0": "quantized::linear"}
    shown = invoke("show-backend", NAME, "--json").json()
    assert shown["pattern_configs"][0]["kernel"] == "quantized::linear"


def _ranges(backend: str) -> tuple[tuple[int, int], tuple[int, int]]:
    qconfig = qp.get_default_qconfig_mapping(backend=backend).global_qconfig
    activation, weight = qconfig.activation(), qconfig.weight()
    return (activation.quant_min, activation.quant_max), (weight.quant_min, weight.quant_max)


def test_scaffold_defaults_are_full_8_bits_with_vnni_and_7_bit_weights_without(scaffolded, fake_dist):
    """The scaffold leaves the CPU's limits to the core (it wrote 7-bit activations everywhere)."""
    fake_dist("qplug-acme-npu", module="qplug_acme_npu.plugin:plugin", entry_point=NAME,
              version="0.1.0", location=scaffolded)
    with override_cpu_flags("avx2 fma avx512f avx512bw avx512vl avx512_vnni"):
        assert _ranges(NAME) == ((0, 255), (-128, 127))
    with override_cpu_flags("avx2 fma"):
        assert _ranges(NAME) == ((0, 255), (-64, 64))


def test_plugin_module_is_short_and_uses_only_the_plugin_api(scaffolded):
    source = (scaffolded / "qplug_acme_npu" / "plugin.py").read_text()
    assert len(source.splitlines()) <= 35
    imported = {line.split()[1] for line in source.splitlines() if line.startswith(("from ", "import "))}
    assert {m for m in imported if m.startswith("qplug_core")} == {"qplug_core.plugin_api"}


@pytest.mark.parametrize("name,fragment", [("Acme-NPU", "must start with a lowercase letter"),
                                           ("reference", "already installed")])
def test_bad_names(tmp_path, name, fragment):
    assert_one_line_error(invoke("new-backend", name, "--dir", str(tmp_path)), fragment)
    assert not any(tmp_path.iterdir())


def test_existing_directory_is_not_overwritten(scaffolded):
    assert_one_line_error(invoke("new-backend", NAME, "--dir", str(scaffolded.parent)),
                          "already exists")


def test_core_requirement_admits_the_running_core():
    assert core_requirement("0.1.0") == "qplug-core>=0.1"
    assert core_requirement("1.4.2") == "qplug-core>=1.4"
    from packaging.requirements import Requirement

    assert Requirement(core_requirement(qp.__version__)).specifier.contains(qp.__version__)


DEMO_SCRIPT = textwrap.dedent(f"""
    import json
    import qplug_core as qp
    from qplug_core.zoo.digits import accuracy, load_digits_tensors, train_digits_cnn

    model, float_acc = train_digits_cnn(epochs=2)
    x_train, _, x_test, y_test = load_digits_tensors()
    qmodel = qp.quantize(model, (x_train[:1],), [x_train[:256]], backend="{NAME}", progress=False)
    print(json.dumps({{"kernels": qp.quantization_report(qmodel).kernels,
                       "float": float_acc, "int8": accuracy(qmodel, x_test, y_test)}}))
""")


@pytest.mark.slow
def test_printed_install_command_works_in_a_fresh_venv(tmp_path, monkeypatch):
    """The 'next:' command run as printed (offline: no index, no build isolation), then the
    package is listed, quantizes the digits model, and its own tests pass."""
    monkeypatch.chdir(tmp_path)
    result = invoke("new-backend", NAME)
    printed = result.stderr.split("next: ", 1)[1].split(" && ")[0].split()
    assert printed[:3] == ["pip", "install", "-e"]
    python = child_venv(tmp_path / "venv")
    install = pip_install_into(python, *printed[2:], cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}

    listed = subprocess.run([str(python), "-m", "qplug_core.cli.app", "list-backends", "--json"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)["backends"]}
    assert rows[NAME]["status"] == "ok" and rows[NAME]["available"]
    assert rows[NAME]["plugins"][0]["dist"] == "qplug-acme-npu"

    demo = subprocess.run([str(python), "-c", DEMO_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert demo.returncode == 0, demo.stderr
    result = json.loads(demo.stdout)
    assert result["kernels"] == {"fc": "quantized::linear"}
    assert result["int8"] > result["float"] - 0.05

    own_tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
                                "tests"],
                               capture_output=True, text=True, env=env, cwd=tmp_path / "qplug-acme-npu",
                               timeout=600)
    assert own_tests.returncode == 0, own_tests.stdout[-3000:]

"""``qplug new-backend``: the scaffolded plugin package is valid, discoverable, and, installed into
a throw-away venv, listed by ``qplug list-backends`` and able to quantize the demo model."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
from cli_testkit import assert_one_line_error, invoke

import qplug_core as qp
from qplug_core import plugins
from qplug_core.commands.new_backend import core_requirement

NAME = "acme_npu"


@pytest.fixture
def scaffolded(tmp_path: Path) -> Path:
    result = invoke("new-backend", NAME, "--dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "qplug-acme-npu"
    assert result.stdout.split() == [str(root / p) for p in (
        "README.md", "pyproject.toml", "qplug_acme_npu/__init__.py", "qplug_acme_npu/plugin.py",
        "tests/test_plugin.py")]
    assert "pip install" in result.stderr
    return root


def test_pyproject_declares_the_entry_point(scaffolded):
    project = tomllib.loads((scaffolded / "pyproject.toml").read_text())["project"]
    assert project["name"] == "qplug-acme-npu"
    assert project["entry-points"]["qplug"] == {NAME: "qplug_acme_npu.plugin"}
    assert core_requirement(qp.__version__) in project["dependencies"]
    assert "{{" not in "".join(p.read_text() for p in scaffolded.rglob("*") if p.is_file())


def test_plugin_is_discovered_and_quantizes(scaffolded, monkeypatch):
    """Installed the fake_dist way: a dist-info beside the package on sys.path."""
    info = scaffolded / "qplug_acme_npu-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qplug-acme-npu\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[qplug]\n{NAME} = qplug_acme_npu.plugin\n")
    monkeypatch.syspath_prepend(str(scaffolded))
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-acme-npu")
    importlib.invalidate_caches()
    plugins.reset()
    try:
        (row,) = [r for r in qp.list_backends() if r.name == NAME]
        assert row.status == "ok" and row.n_pattern_configs == 1 and row.engine == "fbgemm"
        model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
        x = torch.randn(4, 8)
        qmodel = qp.quantize(model, (x,), [x], backend=NAME, progress=False)
        assert qp.quantization_report(qmodel).kernels == {"0": "quantized::linear"}
        shown = invoke("show-backend", NAME, "--json").json()
        assert shown["pattern_configs"][0]["kernel"] == "quantized::linear"
    finally:
        for module in ("qplug_acme_npu", "qplug_acme_npu.plugin"):
            sys.modules.pop(module, None)


@pytest.mark.parametrize("name,fragment", [("Acme-NPU", "must start with a lowercase letter"),
                                           ("reference", "already installed")])
def test_bad_names(tmp_path, name, fragment):
    assert_one_line_error(invoke("new-backend", name, "--dir", str(tmp_path)), fragment)
    assert not any(tmp_path.iterdir())


def test_existing_directory_is_not_overwritten(scaffolded):
    assert_one_line_error(invoke("new-backend", NAME, "--dir", str(scaffolded.parent)),
                          "already exists")


def test_core_requirement():
    assert core_requirement("0.1.0") == "qplug-core>=0.1,<0.2"
    assert core_requirement("1.4.2") == "qplug-core>=1.4,<2"


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
def test_installs_into_a_fresh_venv(scaffolded, tmp_path):
    """A real ``pip install`` (no index, no build isolation: everything comes from /work/venv)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    python = venv / "bin" / "python"
    # --system-site-packages reaches the base interpreter, not this venv: chain this venv's
    # site-packages (and its editable installs' .pth files) in explicitly
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "_parent_venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                              "--no-index", "--no-build-isolation", str(scaffolded)],
                             capture_output=True, text=True, env=env, timeout=300)
    assert install.returncode == 0, install.stderr
    assert (Path(purelib) / "qplug_acme_npu").is_dir()

    listed = subprocess.run([str(python), "-m", "qplug_core.cli", "list-backends", "--json"],
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

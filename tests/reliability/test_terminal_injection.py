"""Strings from a file or a plugin reach the terminal as text: no markup, no escape sequences
(issue 27, finding 4).

``qplug report`` rendered a saved model's strings as rich markup (a version ``"[/red]"`` exited 1
with a MarkupError traceback) and passed escape sequences (window title, clear screen) to stdout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from artifactkit import rewrite_header
from torch import nn
from typer.testing import CliRunner

import qplug_core as qp
from qplug_core.cli.app import app

TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
HOSTILE = f"{TITLE}[/red][bold]{CLEAR}\u202eevil"


def invoke(*args: str, columns: int = 100):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    data = [torch.randn(4, 8) for _ in range(2)]
    return qp.save(qp.quantize(model, data[0], data, backend="reference"),
                   tmp_path_factory.mktemp("report") / "model.safetensors")


def test_file_strings_print_literally_with_controls_escaped(saved, tmp_path):
    def edit(document):
        document["model"]["fusions"][0]["fused_type"] = HOSTILE
    path = rewrite_header(saved, tmp_path / "hostile.safetensors", edit)
    result = invoke("report", str(path), columns=200)
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "\\x1b]0;pwned\\x07[/red][bold]\\x1b[2J\\u202eevil" in result.stdout


@pytest.mark.parametrize("versions, field", [
    ({"qplug-core": "0.1.0", "torch": "[/red]"}, "versions.torch"),
    ({"qplug-core": "0.1.0", TITLE: "1.0"}, "versions"),
    ({"qplug-core": "0.1.0", "torch": 2.13}, "versions.torch"),
    ({"qplug-core": "0.1.0", "torch": "1" * 65}, "versions.torch"),
])
def test_the_versions_object_is_validated(saved, tmp_path, versions, field):
    def edit(document):
        document["versions"] = versions
    path = rewrite_header(saved, tmp_path / "hostile.safetensors", edit)
    with pytest.raises(qp.errors.SerializationError, match=field.replace(".", r"\.")):
        qp.load(path)
    result = invoke("report", str(path))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("qplug: error: ") and result.stderr.count("\n") == 1
    assert "is not" in result.stderr and "\x1b" not in result.stderr

"""Command-line inputs that used to end in a traceback, and user code printing into ``--json``
(issue 17): each bad input is one ``qplug: error:`` line on stderr and exit code 1."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qplug_core.cli.app import app

MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


print("importing the user's models")


def chatty():
    print("building the model")
    torch.manual_seed(0)
    return Net().eval()
'''

HUGE_SHAPE = "100000,100000,100000"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "usermodels.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("usermodels", None)


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback the user would have seen
    return result


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qplug: error: "), result.stderr
    for fragment in fragments:
        assert fragment in last, last


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores permission bits)."""
    if os.geteuid() == 0:
        if not Path("/sys").is_dir():
            pytest.skip("running as root without a read-only /sys to write into")
        return Path("/sys/qplug-unwritable")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return locked


def test_new_backend_into_an_unwritable_dir(workdir):
    target = unwritable_directory(workdir)
    result = invoke("new-backend", "acme", "--dir", str(target))
    assert_one_line_error(result, f"cannot create {target / 'qplug-acme'}", "pass a writable --dir")
    assert not (target / "qplug-acme").exists()


@pytest.mark.parametrize("below", ["", "sub"], ids=["the-file", "below-a-file"])
def test_new_backend_with_a_dir_that_is_a_file(workdir, below):
    (workdir / "notes.txt").write_text("not a directory")
    target = Path("notes.txt") / below if below else Path("notes.txt")
    result = invoke("new-backend", "acme", "--dir", str(target))
    assert_one_line_error(result, f"--dir {target}: notes.txt is a file, not a directory")


@pytest.mark.parametrize("command", [
    ["quantize", "usermodels:chatty", "--out", "m.safetensors"],
    ["bench", "usermodels:chatty", "--runs", "3"],
], ids=["quantize", "bench"])
def test_impossible_example_shape(workdir, command):
    result = invoke(*command, "--example-shape", HUGE_SHAPE, "--backend", "reference")
    assert_one_line_error(result, f"--example-shape {HUGE_SHAPE} needs 1,000,000,000,000,000 float32 "
                                  "values", "cannot be allocated here")


def test_example_shape_the_model_cannot_take(workdir):
    result = invoke("quantize", "usermodels:chatty", "--out", "m.safetensors", "--example-shape",
                    "2,3", "--backend", "reference")
    assert_one_line_error(result, "the model cannot run on the example inputs ((2, 3))")


def test_factory_printing_to_stdout_does_not_corrupt_json(workdir):
    result = invoke("quantize", "usermodels:chatty", "--out", "m.safetensors", "--example-shape",
                    "2,3,8,8", "--backend", "reference", "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)  # only the document on stdout
    assert document["model"] == "usermodels:chatty" and (workdir / "m.safetensors").is_file()
    assert "importing the user's models" in result.stderr and "building the model" in result.stderr

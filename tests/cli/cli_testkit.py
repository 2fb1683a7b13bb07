"""Helpers of the CLI tests: run ``qplug`` in-process (typer's CliRunner, stdout and stderr apart)
or as the installed script (whose environment inherits the built-in-plugins-only switch of
``tests/conftest.py``), and check the one-line error contract."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from qplug_core.cli.app import app

QPLUG = Path(sys.executable).with_name("qplug")

MODELS_SOURCE = '''
import torch
from torch import nn

import qplug_core as qp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.relu(self.bn(self.conv(x))), 1))


def build():
    torch.manual_seed(0)
    return Net().eval()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)).eval()


class SizeBranch(Net):
    """Branches on its input's size: symbolic tracing fails, torch.export takes it."""

    def forward(self, x):
        return super().forward(x) if x.shape[2] > 0 else x


def size_branch():
    torch.manual_seed(0)
    return SizeBranch().eval()


def broken():
    raise RuntimeError("weights.bin is missing")


def not_a_model():
    return 42


def qat():
    model = qp.prepare_qat_fx(build().train(), None, (torch.randn(2, 3, 8, 8),), backend="reference")
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8))
    return model
'''

SHAPE = "2,3,8,8"


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def invoke(*args: str, columns: int = 80) -> Result:
    """Run ``qplug ARGS`` in-process; ``columns`` is the width rich lays tables out for."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.stdout, result.stderr)


def run(*args: str, cwd: Path | None = None, timeout: float = 300) -> Result:
    """Run the installed ``qplug`` script as a real process."""
    done = subprocess.run([str(QPLUG), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)
    return Result(done.returncode, done.stdout, done.stderr)


def assert_one_line_error(result: Result, *fragments: str, code: int = 1) -> None:
    """A user error: the exit code, nothing on stdout, one ``qplug: error:`` line on stderr."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("qplug: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]

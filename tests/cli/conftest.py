"""Fixtures of the CLI tests: a user's model module in the current directory and calibration
data."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch
from cli_testkit import MODELS_SOURCE


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of model factories in the current directory; returns its (unique) name."""
    name = f"usermodels_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODELS_SOURCE))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def calibration_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "calib.safetensors"
    gen = torch.Generator().manual_seed(1)
    save_file({f"batch{i}": torch.randn(4, 3, 8, 8, generator=gen) for i in range(3)}, str(path))
    return path

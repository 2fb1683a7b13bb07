"""Fixtures of the CLI tests: a user's model module in the current directory, calibration data,
and a skip for tests that need ``qp.save`` while qplug_core/serialization is being written."""

from __future__ import annotations

import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch
from cli_testkit import MODELS_SOURCE

import qplug_core as qp
from qplug_core.errors import SerializationError


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


def _save_works() -> str | None:
    """Why qp.save cannot save a converted model yet, or None once it can."""
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4)).eval()
    x = torch.randn(2, 4)
    qmodel = qp.quantize(model, (x,), [x], backend="reference", progress=False)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            qp.save(qmodel, Path(scratch) / "m.safetensors")
    except SerializationError as exc:
        return str(exc)
    return None


@pytest.fixture
def requires_save() -> None:
    """Skip until qp.save works on converted models (qplug_core/serialization is in progress)."""
    reason = _save_works()
    if reason is not None:
        pytest.skip("qp.save cannot save converted models yet (convert_fx does not call "
                    f"qplug_core.serialization.record_artifact): {reason[:120]}")

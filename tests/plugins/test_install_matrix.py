"""Tier 3 of plugin testing: real wheels of the three distributions in a fresh venv (B5, G10).

Runs ``scripts/install_matrix.sh``: core + qnnpack lists no fbgemm; core + both plugins lists
reference, fbgemm and qnnpack; core + onnxruntime alone lists reference and onnxruntime; core +
openvino alone lists reference and openvino. About 2-3 minutes (torch is installed into the venv), hence ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_install_matrix():
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    result = subprocess.run(["bash", str(REPO / "scripts" / "install_matrix.sh")], capture_output=True,
                            text=True, env={**env, "PYTHON": sys.executable}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "install_matrix: ok: qnnpack, reference" in result.stdout
    assert "install_matrix: ok: fbgemm, qnnpack, reference" in result.stdout
    assert "install_matrix: ok: onnxruntime, reference" in result.stdout
    assert "install_matrix: ok: openvino, reference" in result.stdout

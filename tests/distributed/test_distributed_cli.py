"""``qplug quantize`` under torchrun: each rank calibrates on its share of ``--calibration``.

Rank r takes batches r, r + 2, ... of the file, so global step t is batches 2t and 2t + 1
together; ``qplug quantize`` in one process on those pairs concatenated must save the same file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import launch
import pytest
import torch
from safetensors.torch import save_file

FACTORY = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("cli")
    (work / "netfactory.py").write_text(FACTORY)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 3, 8, 8, generator=generator) * (1 + i) for i in range(4)]
    save_file({f"b{i}": b for i, b in enumerate(batches)}, str(work / "shards.safetensors"))
    save_file({f"g{t}": torch.cat(batches[2 * t:2 * t + 2]) for t in range(2)},
              str(work / "global.safetensors"))
    return work


def test_torchrun_quantize_saves_the_single_process_model(workdir):
    quantize = ["-m", "qplug_core.cli.app", "quantize", "netfactory:build", "--example-shape",
                "1,3,8,8", "--backend", "fbgemm"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(launch.free_port()), *quantize,
                "--calibration", "shards.safetensors", "--out", "ranks.safetensors"]
    single = [sys.executable, *quantize, "--calibration", "global.safetensors",
              "--out", "single.safetensors"]
    env = launch.worker_env(0, 1, launch.free_port())
    results = launch.run_all([(torchrun, env), (single, env)], timeout=240, cwd=workdir)
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert launch.saved_model(workdir / "ranks.safetensors") == launch.saved_model(workdir / "single.safetensors")
    # only rank 0 saves and reports
    assert results[0].stdout.count("ranks.safetensors") == 1

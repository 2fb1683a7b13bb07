"""One rank of the distributed QAT test under DistributedDataParallel, or (WORLD_SIZE=1) the
single-process reference training on the global batches.

``python qat_worker.py OUT_DIR``. Cases: BatchNorm statistics frozen (the forward pass is per
sample, so DDP and one process compute the same thing up to the rounding of gradient averaging),
BatchNorm training (each rank normalises with its own batch, so only the ranks agree exactly),
observers synced every 2 steps, and plain DDP without qplug's synchronisation (the control). Each process writes, per case, the fake-quant qparams, the
int8 model converted on that rank (``qp.save``) and its output on a fixed input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import launch
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qplug_core as qp
from qplug_core.nn.qat_base import freeze_bn_stats
from qplug_core.observers import FakeQuantize

STEPS, PER_RANK, RANKS = 4, 4, 2
#: case -> (freeze BatchNorm statistics, sync observers every k steps; 0: plain DDP, no qplug sync)
CASES = {"bn_frozen": (True, 1), "bn_training": (False, 1), "every_2_steps": (False, 2),
         "unsynced": (True, 0)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.bn(self.conv(x))).flatten(1))


def global_steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        x = torch.randn(PER_RANK * RANKS, 3, 8, 8, generator=generator)
        x[PER_RANK:] *= 3.0  # rank 1's part
        steps.append((x, torch.randint(0, 10, (PER_RANK * RANKS,), generator=generator)))
    return steps


def fake_quant_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantize):
            state[f"{name}.scale"] = module.scale.detach().clone()
            state[f"{name}.zero_point"] = module.zero_point.detach().clone()
    return state


def untrained() -> nn.Module:
    return qp.prepare_qat_fx(Net(), None, (torch.randn(1, 3, 8, 8),), backend="fbgemm")


def train(freeze_bn: bool, every: int, rank: int, world: int) -> nn.Module:
    torch.manual_seed(0)
    example = (torch.randn(1, 3, 8, 8),)
    prepared = qp.prepare_qat_fx(Net(), qp.get_default_qconfig_mapping("fbgemm", "qat"), example,
                                 backend="fbgemm")
    if freeze_bn:
        prepared.apply(freeze_bn_stats)
    if world == 1:
        model = prepared
    elif every == 0:
        model = DistributedDataParallel(prepared, forward_sync_buffers=False)
    else:
        model = qp.distributed.data_parallel(prepared, sync_every=every)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for x, y in global_steps():
        if world > 1:
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if world > 1 and every:
        model.observer_sync.remove()
        qp.sync_observers(prepared)  # agree once more before converting (needed with every > 1)
    return prepared.eval()


def main(out: Path) -> None:
    rank, world, tag = launch.join()
    probe = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2
    for name, (freeze_bn, every) in CASES.items():
        if world == 1 and every != 1:
            continue
        prepared = train(freeze_bn, every, rank, world)
        save_file(fake_quant_state(prepared), str(out / f"{name}.fq.{tag}.safetensors"))
        int8 = qp.convert_fx(prepared)
        qp.save(int8, out / f"{name}.int8.{tag}.safetensors")
        save_file({"output": int8(probe)}, str(out / f"{name}.out.{tag}.safetensors"))
    if world == 1:
        return
    launch.write_errors(out / f"errors.{tag}.txt", [
        lambda: qp.distributed.data_parallel(untrained(), broadcast_buffers=True),
        lambda: qp.distributed.data_parallel(untrained(), sync_batchnorm=True),
    ])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

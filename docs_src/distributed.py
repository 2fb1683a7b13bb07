"""Calibration and QAT on several processes: torchrun --standalone --nproc-per-node 2 distributed.py

Run directly, it starts 2 local ranks under torchrun itself (gloo, CPU).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import qplug_core as qp


def build() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs, after torch.cuda.set_device(local_rank)
    rank = dist.get_rank()
    example = (torch.randn(1, 3, 8, 8),)
    images = TensorDataset(torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(1)))

    # Static PTQ: each rank calibrates on its shard; the observers agree as if one process had
    # seen every rank's batches together, so every rank converts to the same int8 model.
    observed = qp.prepare_fx(build().eval(), None, example, backend="fbgemm")
    loader = DataLoader(images, batch_size=8, sampler=DistributedSampler(images, shuffle=False))
    qp.calibrate(observed, loader)  # a progress bar on rank 0 only (on a terminal)
    int8 = qp.convert_fx(observed)
    if rank == 0:
        qp.save(int8, Path(tempfile.mkdtemp()) / "model.safetensors")
        print("PTQ, saved by rank 0:", qp.quantization_report(int8).kernels)

    # QAT under DistributedDataParallel: fake-quant observers reduce every step, BatchNorm
    # running statistics are averaged (or sync_batchnorm=True on GPUs), no buffer broadcast.
    prepared = qp.prepare_qat_fx(build(), None, example, backend="fbgemm")
    model = qp.distributed.data_parallel(prepared, sync_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for (x,) in loader:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.observer_sync.remove()
    qp.sync_observers(prepared)  # the last step's BatchNorm statistics, and every=k tails
    int8 = qp.convert_fx(prepared.eval())  # the same int8 model on every rank
    if rank == 0:
        print("QAT, converted on rank 0:", qp.quantization_report(int8).kernels)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        main()
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", __file__],
                              capture_output=True, text=True, check=True)
        print(done.stdout, end="")

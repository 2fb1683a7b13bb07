"""One rank of the distributed calibration tests, or (WORLD_SIZE=1) the single-process reference.

``python calibration_worker.py OUT_DIR``. Every case calibrates the same seeded model; a rank
calibrates on its part of each global batch, the reference on the global batches themselves (the
ranks' batches concatenated in rank order). Each process writes, per case, the int8 model
(``qp.save``) or the observers' qparams and statistics as ``<case>.<rank|single>.safetensors``;
the test compares the files byte for byte. Rank 1's data is 3x wider than rank 0's, so a rank
that kept its own statistics would produce a different file. One process group serves every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import launch
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import qplug_core as qp
from qplug_core import observers as obs
from qplug_core.config import QConfig, QConfigMapping

STEPS, PER_RANK, RANKS = 3, 4, 2


def global_batches(shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randn(PER_RANK * RANKS, *shape, generator=generator) for _ in range(STEPS)]
    for batch in batches:
        batch[PER_RANK:] *= 3.0  # rank 1's part
    return batches


def shard(batches: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    if world == 1:
        return batches
    return [b[rank * PER_RANK:(rank + 1) * PER_RANK] for b in batches]


class Net(nn.Module):
    """conv-relu, conv-sigmoid (fixed qparams), linear: every kind of observer the mapping uses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.conv2(self.relu(self.conv1(x))))
        return self.fc(y.flatten(1))


def mapping(activation=None, weight=None) -> QConfigMapping:
    default = qp.get_default_qconfig_mapping("fbgemm")
    if activation is None and weight is None:
        return default
    base = default.global_qconfig
    return QConfigMapping().set_global(QConfig(activation=activation or base.activation,
                                               weight=weight or base.weight))


ACT = {"dtype": torch.quint8, "quant_min": 0, "quant_max": 127}
SEVEN_BIT_ACTIVATIONS = obs.HistogramObserver.with_args(**ACT)
MODEL_CASES = {
    "fbgemm_default": mapping(),
    "act_minmax": mapping(obs.MinMaxObserver.with_args(**ACT)),
    "act_moving_average": mapping(obs.MovingAverageMinMaxObserver.with_args(averaging_constant=0.3,
                                                                           **ACT)),
    "act_histogram": mapping(obs.HistogramObserver.with_args(bins=256, **ACT)),
    "act_percentile": mapping(obs.PercentileObserver.with_args(percentile=99.0, **ACT)),
    "act_mse": mapping(obs.MSEObserver.with_args(**ACT)),
    # full 8-bit weights beside 7-bit activations: pairs fit int16 on every CPU (with 8-bit ones
    # fbgemm's AVX2 kernels saturate, and a kernel the contract check refuses on one rank's example
    # inputs and keeps on another's makes the files differ for a reason that is not calibration)
    "weight_minmax": mapping(SEVEN_BIT_ACTIVATIONS, obs.MinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)),
    "weight_moving_average_per_channel": mapping(
        SEVEN_BIT_ACTIVATIONS, obs.MovingAveragePerChannelMinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric)),
}


def observer_zoo() -> nn.Sequential:
    """Every shipped observer and fake-quant class, each watching the same (N, 4, 5) activations."""
    per_channel = {"ch_axis": 1, "dtype": torch.qint8, "qscheme": torch.per_channel_symmetric}
    return nn.Sequential(
        obs.MinMaxObserver(),
        obs.MovingAverageMinMaxObserver(averaging_constant=0.3),
        obs.PerChannelMinMaxObserver(**per_channel),
        obs.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.3, **per_channel),
        obs.HistogramObserver(bins=128),
        obs.PercentileObserver(bins=128, percentile=98.0),
        obs.MSEObserver(bins=128),
        obs.FixedQParamsObserver(scale=1 / 256, zero_point=0),
        obs.PlaceholderObserver(dtype=torch.float16),
        obs.FakeQuantize(averaging_constant=0.3),
        obs.FakeQuantize(observer=obs.MovingAveragePerChannelMinMaxObserver, **per_channel),
        obs.FixedQParamsFakeQuantize(observer=obs.default_fixed_qparams_range_0to1_observer),
        obs.LearnableFakeQuantize(),
    )


def observer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers, parameters and qparams of every observer, as one flat dict of tensors."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if v.numel()}
    for index, module in enumerate(model):
        if isinstance(module, obs.PlaceholderObserver):
            continue
        scale, zero_point = module.calculate_qparams()
        state[f"{index}.qparams.scale"] = scale.detach().clone()
        state[f"{index}.qparams.zero_point"] = zero_point.detach().clone()
    return state


class Twice(nn.Module):
    """Observers called twice in one forward: the second call sees the first one's update."""

    def __init__(self) -> None:
        super().__init__()
        self.histogram = obs.HistogramObserver(bins=64)
        self.average = obs.MovingAverageMinMaxObserver(averaging_constant=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for y in (x, 2 * x - 1):
            self.average(self.histogram(y))
        return x


class UndeclaredObserver(obs.MinMaxObserver):
    """A plugin's observer that gathers statistics its own way without saying how they reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.abs())


def main(out: Path) -> None:
    rank, world, tag = launch.join()
    example = (torch.randn(1, 3, 8, 8),)

    for name, qconfig_mapping in MODEL_CASES.items():
        torch.manual_seed(0)
        observed = qp.prepare_fx(Net().eval(), qconfig_mapping, example, backend="fbgemm")
        qp.calibrate(observed, shard(global_batches((3, 8, 8)), rank, world), progress=False)
        qp.save(qp.convert_fx(observed), out / f"{name}.{tag}.safetensors")

    # dynamic quantization (placeholder activation observers), calibrated like static
    torch.manual_seed(0)
    dynamic = qp.prepare_fx(Net().eval(), qp.get_default_qconfig_mapping("fbgemm", "dynamic"),
                            example, backend="fbgemm")
    qp.calibrate(dynamic, shard(global_batches((3, 8, 8)), rank, world), progress=False)
    qp.save(qp.convert_fx(dynamic), out / f"dynamic.{tag}.safetensors")

    # a DataLoader over a DistributedSampler; the reference sees each step's rank batches together
    samples = torch.cat(global_batches((3, 8, 8), seed=1))
    dataset = TensorDataset(samples)

    def loader(for_rank: int) -> DataLoader:
        sampler = DistributedSampler(dataset, num_replicas=RANKS, rank=for_rank, shuffle=False)
        return DataLoader(dataset, batch_size=PER_RANK, sampler=sampler)

    if world == 1:
        data = [torch.cat([b for (b,) in step]) for step in zip(*(loader(r) for r in range(RANKS)))]
    else:
        data = loader(rank)
    torch.manual_seed(0)
    observed = qp.prepare_fx(Net().eval(), None, example, backend="fbgemm")
    qp.calibrate(observed, data, progress=(world > 1))
    qp.save(qp.convert_fx(observed), out / f"sampler.{tag}.safetensors")

    # every shipped observer class on its own, through qp.calibrate
    zoo = observer_zoo()
    qp.calibrate(zoo, shard(global_batches((4, 5)), rank, world), progress=False)
    save_file(observer_state(zoo), str(out / f"zoo.{tag}.safetensors"))

    twice = Twice()
    qp.calibrate(twice, shard(global_batches((4, 5)), rank, world), progress=False)
    save_file({k: v.clone() for k, v in twice.state_dict().items()},
              str(out / f"twice.{tag}.safetensors"))

    if world == 1:
        return
    # a custom loop with only the final reduction: min/max observers are still exact
    zoo = nn.Sequential(obs.MinMaxObserver(), obs.PerChannelMinMaxObserver(ch_axis=1))
    with torch.no_grad():
        for batch in shard(global_batches((4, 5)), rank, world):
            zoo(batch)
    assert qp.sync_observers(zoo) == 2
    save_file(observer_state(zoo), str(out / f"custom_loop.{tag}.safetensors"))

    # refusals, raised on every rank (none waits for the other)
    launch.write_errors(out / f"errors.{tag}.txt", [
        lambda: qp.calibrate(nn.Sequential(UndeclaredObserver()),
                             shard(global_batches((4, 5)), rank, world), progress=False),
        lambda: qp.calibrate(nn.Sequential(obs.MinMaxObserver()),
                             global_batches((4, 5))[:2 + rank], progress=False),
    ])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

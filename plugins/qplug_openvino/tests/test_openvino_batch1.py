"""A ViT's embedding (class token expanded to the batch, concatenated, a position table added)
calibrated at batch 2 and called at batch 1, the common serving size: OpenVINO removes the
no-op ``expand`` of the batch-1 model and names the token's port ``expand``, which the compile
could not match to an input (``tuple.index``), so batch 1 ran the reference form in memory and a
loaded model called at batch 1 first raised."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from ov_testkit import output_step
from torch import nn

import qplug_core as qp

from qplug_openvino.compiled import OpenVinoPartition


class TinyViT(nn.Module):
    """Patch conv, class token and position table, one linear, a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, 4)
        self.token = nn.Parameter(torch.randn(1, 1, 16))  # its name sorts after "expand"
        self.position = nn.Parameter(torch.randn(1, 5, 16))
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.token.expand(x.shape[0], -1, -1), h], 1) + self.position
        return self.head(torch.relu(self.fc(h))[:, 0])


def _images(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _compiled(model: nn.Module) -> OpenVinoPartition:
    (partition,) = [m for m in model.modules() if isinstance(m, OpenVinoPartition)]
    return partition


@pytest.mark.slow  # one quantize, a save and a load with compiles at batch 1: 67-250 s on this shared machine
def test_vit_calibrated_at_batch_2_answers_batch_1_compiled_also_after_load(tmp_path):
    torch.manual_seed(0)
    calibration = [(_images(2, seed),) for seed in range(4)]
    observed = qp.calibrate(qp.prepare_fx(TinyViT().eval(), None, calibration[0], backend="openvino"),
                            calibration)
    reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
    ov_model = qp.convert_fx(observed)
    path = qp.save(ov_model, tmp_path / "vit.safetensors")
    x = _images(1, 9)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no reference-form fallback, said or not
        expected = reference(x)
        for model in (ov_model, qp.load(path)):  # loaded: batch 1 is its first call
            assert (model(x) - expected).abs().max() <= output_step(expected)
            partition = _compiled(model)
            assert partition.refused == {}
            assert [shape[0] for shape, _ in partition.signatures[-1]] == [1]  # token and table: constants

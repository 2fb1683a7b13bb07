"""A delegated convert says each partition it compiled and checked, as calibration shows its
batches: it was silent for minutes on a big model."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import qplug_core as qp


class TwoPartitions(nn.Module):
    """Two convs with a recurrent layer between them, which ONNX Runtime does not take: two partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gru, self.conv2 = nn.Conv1d(4, 8, 3), nn.GRU(8, 8, batch_first=True), nn.Conv1d(8, 4, 1)

    def forward(self, x):
        y, _ = self.gru(torch.relu(self.conv(x)).transpose(1, 2))
        return self.conv2(y.transpose(1, 2))


@pytest.mark.filterwarnings("ignore:.*weights stay float:UserWarning")
@pytest.mark.parametrize("progress", [True, None])
def test_convert_says_each_partition_compiled_and_checked(capfd, progress):
    torch.manual_seed(0)
    data = [(torch.randn(2, 4, 12),) for _ in range(2)]
    observed = qp.calibrate(qp.prepare_fx(TwoPartitions().eval(), None, data[0], backend="onnxruntime"), data,
                            progress=False)
    capfd.readouterr()
    lowered = qp.convert_fx(observed, progress=progress)
    lines = re.findall(r"^qplug: onnxruntime: compiling and checking partitions: .*$", capfd.readouterr().err, re.M)
    partitions = [p["name"] for p in qp.quantization_report(lowered).partitions]
    assert partitions == ["delegate_0", "delegate_1"]
    if progress:  # stderr is not a terminal here: a line each
        assert [re.sub(r"\(\d+ nodes\)|\d+\.\d s", "", line) for line in lines] == [
            f"qplug: onnxruntime: compiling and checking partitions: partition {name}  done ({i} of 2, )"
            for i, name in enumerate(partitions, 1)]
    else:  # None: only on a terminal (False: never)
        assert lines == []

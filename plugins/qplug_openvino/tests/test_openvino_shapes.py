"""New input shapes and threads on openvino: one compiled model serves every size the
partition's graph leaves free (batch and the time axis of a ``(batch, channels, time)`` signal),
and calls from several threads at once answer as serial calls do."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import ConfigValidationError

from qplug_openvino import configure
from qplug_openvino.compiled import OpenVinoPartition


def signal(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.cumsum(0.1 * torch.randn(batch, 6, length, generator=torch.Generator().manual_seed(seed)), -1)


@pytest.fixture(scope="module")
def conv1d():
    """(openvino model, reference form) of a 1-D CNN quantized at batch 2, 64 steps."""
    model = nn.Sequential(nn.Conv1d(6, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 8, 3)).eval()
    data = [(signal(2, 64, seed),) for seed in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, data[0], backend="openvino")
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        return qp.convert_fx(observed), reference


def test_one_compiled_model_serves_every_length_and_batch_the_graph_leaves_free(conv1d):
    ov_model, reference = conv1d
    (partition,) = [m for m in ov_model.modules() if isinstance(m, OpenVinoPartition)]
    with torch.no_grad():
        for batch, length in ((2, 40), (3, 100), (5, 257), (2, 3)):  # 3: the smallest a kernel-3 conv takes
            x = signal(batch, length, seed=batch + length)
            got, expected = ov_model(x), reference(x)
            assert got.shape == (batch, 8, length - 2)
            # the last conv writes float (no int8 op reads it): one step of its range / 255
            assert (got - expected).abs().max() <= float(expected.max() - expected.min()) / 255 * 1.001
    assert len(partition.compiled_models) == 1
    assert partition.compiled_models[0].inputs[0].get_partial_shape().is_dynamic


def test_calls_from_several_threads_at_once_answer_as_serial_calls(conv1d):
    ov_model, _ = conv1d
    xs = [signal(2, 64 + 8 * i, seed=i) for i in range(8)]
    with torch.no_grad():
        serial = [ov_model(x) for x in xs]
    answers: dict[int, list[torch.Tensor]] = {}
    start = threading.Barrier(4)

    def client(k: int) -> None:
        start.wait()
        with torch.no_grad():
            answers[k] = [ov_model(x) for x in xs[k:] + xs[:k]]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert all(torch.equal(got, want) for got, want in zip(answers[k], serial[k:] + serial[:k], strict=True))


def test_the_cache_size_is_a_setting():
    with pytest.raises(ConfigValidationError, match="shape_cache_size must be an int >= 1"):
        configure(shape_cache_size=0)

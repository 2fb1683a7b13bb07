"""A delegated partition reads its parameters, buffers and folded constants inside itself.

A ViT's class token and position table were inputs of its partition, fed from PyTorch at every
call (the partitioner takes call nodes only); they are now constants (initializers) of the
partition's ONNX model. Files saved before stored models taking them as inputs: ``qp.load``
builds those with the constants made initializers, without exporting, and answers as before.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from artifactkit import rewrite
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import CompiledPartition

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]  # ~5 s: one convert

KEY = "partition_models/delegate_0/0"


class PatchTokens(nn.Module):
    """A ViT's embedding in small: 4x4 patches, a class token put in front, a position table added."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, dim)), nn.Parameter(torch.randn(1, 5, dim))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos)


def _images(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("qplug_onnxruntime")
    with torch.random.fork_rng():  # the global generator as the next module's tests find it
        torch.manual_seed(0)
        float_model = PatchTokens().eval()
    with qp.testing.all_plugins_loaded(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibration = [_images(seed) for seed in range(2)]
        model = qp.quantize(float_model, calibration[0], calibration, backend="onnxruntime", recipe="none")
        path = qp.save(model, tmp_path_factory.mktemp("constants") / "tokens.safetensors")
    return model, path


def test_the_partition_is_fed_the_image_only(saved):
    model, _ = saved
    (partition,) = [m for m in model.modules() if isinstance(m, CompiledPartition)]
    assert [n.name for n in partition.partition.graph.find_nodes(op="placeholder")] == ["x"]
    assert [i.name for i in partition.sessions[0].get_inputs()] == ["x"]


def _constants_as_inputs(document, tensors) -> None:
    """The stored model as qp.save wrote it when the class token and position table were inputs."""
    model = onnx.load_model_from_string(tensors[KEY].numpy().tobytes())
    constants = [next(t for t in model.graph.initializer if t.name == name) for name in ("cls", "pos")]
    for tensor in constants:
        model.graph.initializer.remove(tensor)
        model.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    source = model.SerializeToString()
    tensors[KEY] = torch.frombuffer(bytearray(source), dtype=torch.uint8)
    document["model"]["tensors"][KEY]["shape"] = [len(source)]
    stored = document["model"]["partition_models"]["delegate_0"]["models"][0]
    stored["inputs"] += [{"shape": list(tensor.dims), "dtype": "float32"} for tensor in constants]


def test_a_file_whose_stored_model_takes_the_constants_as_inputs_loads_without_exporting(saved, monkeypatch):
    model, path = saved
    older = rewrite(path, _constants_as_inputs)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.onnx.export was called")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the ONNX model the file stores ... is not used"
        loaded = qp.load(older)
        with torch.no_grad():
            for seed in (5, 6):
                assert torch.equal(loaded(*_images(seed)), model(*_images(seed)))


def test_a_file_whose_stored_models_take_the_constants_many_times_over_is_not_built(saved):
    """A hostile file: the older model copied for 100 input signatures (a few KiB each), each given
    the partition's constants as initializers at load: at most 4 times them in all, then the
    partition is exported again with the usual warning."""
    def copied(document, tensors) -> None:
        _constants_as_inputs(document, tensors)
        models = document["model"]["partition_models"]["delegate_0"]["models"]
        for i in range(100):
            key = f"partition_models/delegate_0/copy_{i}"
            tensors[key] = tensors[KEY].clone()
            document["model"]["tensors"][key] = dict(document["model"]["tensors"][KEY])
            models.append({**models[0], "tensor": key})

    _, path = saved
    with pytest.warns(UserWarning, match="stores for partition delegate_0 is not used: its models take the partition's "
                                         "attributes in as initializers more than 4 times over"):
        qp.load(rewrite(path, copied))

"""What a converted model holds in RAM: int8 weights, as its file does, not the float ones again.

The README promises an int8 model "about four times smaller". These tests count the bytes of the
tensors a converted model keeps alive (its parameters and buffers, its kernels' packed weights, the
reference form it keeps for ``qp.save``) against the float model's parameters, and check that the
reference form it keeps still runs and saves bit-exactly.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.registry import plugins

pytestmark = pytest.mark.usefixtures("installed_backends")

WIDTH = 256


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)).eval()


def _quantize(model: nn.Module, backend: str) -> torch.fx.GraphModule:
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qp.quantize(model, (torch.randn(1, WIDTH),), [torch.randn(8, WIDTH) for _ in range(4)],
                           backend=backend)


def _tensor_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor.is_quantized:  # an unpacked kernel weight: one byte an element
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        else:
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += size
    return total


def _held_bytes(qmodel: torch.fx.GraphModule) -> int:
    """Bytes of the tensors ``qmodel`` holds: parameters, buffers, the int8 weights and biases its
    kernels packed (unpacked to count them), and its snapshot's tensors."""
    seen: set[int] = set()
    total = _tensor_bytes([*qmodel.parameters(), *qmodel.buffers()], seen)
    for module in qmodel.modules():
        packed = getattr(module, "_packed", None)
        if packed is not None:
            weight, bias = torch.ops.quantized.linear_unpack(packed)
            total += _tensor_bytes([weight] + ([bias] if bias is not None else []), seen)
    snapshot = snapshot_of(qmodel)
    if snapshot is not None:
        total += _tensor_bytes([*snapshot.held.parameters(), *snapshot.held.buffers()], seen)
    return total


def test_a_converted_fbgemm_mlp_holds_int8_weights_not_float_ones():
    model = _mlp()
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    qmodel = _quantize(model, "fbgemm")
    # the kernels' int8 weights (a quarter), the reference form's (a quarter again), float biases and
    # per-channel qparams (0.518 here); it held the float weights once more before (1.26)
    assert _held_bytes(qmodel) <= 0.55 * float_bytes


def test_the_kept_reference_form_runs_and_saves_bit_exactly(tmp_path):
    model = _mlp()
    qmodel = _quantize(model, "fbgemm")
    x = torch.randn(5, WIDTH)
    reference = snapshot_of(qmodel).graph_module
    assert all(p.dtype == torch.float32 for p in reference.parameters())  # float again, as read
    path = tmp_path / "mlp.safetensors"
    qp.save(qmodel, path)
    assert torch.equal(qp.load(path, backend="reference")(x), reference(x))
    loaded = qp.load(path)
    assert torch.equal(loaded(x), qmodel(x))
    again = tmp_path / "again.safetensors"
    qp.save(loaded, again)
    assert again.read_bytes() == path.read_bytes()
    qp.save(qmodel, again)  # the snapshot read twice gives the same file
    assert again.read_bytes() == path.read_bytes()


@pytest.fixture
def onnxruntime_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        importlib.metadata.version("qplug-onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qplug-onnxruntime is not installed (pip install -e plugins/qplug_onnxruntime)")
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-onnxruntime")
    plugins.reset()


def test_a_delegated_model_keeps_no_float_weights_among_its_parameters(onnxruntime_backend):
    qmodel = _quantize(_mlp(), "onnxruntime")
    assert [name for name, _ in qmodel.named_parameters()] == []
    assert [key for key, value in qmodel.state_dict().items()
            if value.is_floating_point() and value.numel() > 100] == []
    x = torch.randn(5, WIDTH)
    assert torch.allclose(qmodel(x), snapshot_of(qmodel).graph_module(x), atol=0.05)


#: the shape of one weight of ``_counted_mlp``, found in no other tensor of the flow
COUNTED = (96, WIDTH)


def _counted_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 96), nn.ReLU(), nn.Linear(96, WIDTH)).eval()


def _float_copies() -> int:
    """Distinct float32 storages of ``COUNTED`` shape alive now (the model's weight and its copies)."""
    return len({o.untyped_storage().data_ptr() for o in gc.get_objects()
                if type(o) in (torch.Tensor, nn.Parameter)  # not export's storage-less fake tensors
                and o.dtype == torch.float32 and tuple(o.shape) == COUNTED})


def _counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, counts: dict[str, int],
              *, after: bool = False) -> None:
    """Wrap ``owner.name`` to record the float copies of the weight alive when it first starts (or
    returns): where ``qp.quantize``'s peak memory was. Once: a scan of every object takes ~0.1 s."""
    function = getattr(owner, name)

    def counted(*args, **kwargs):
        if not after and name not in counts:
            counts[name] = _float_copies()
        result = function(*args, **kwargs)
        if after and name not in counts:
            counts[name] = _float_copies()
        return result

    monkeypatch.setattr(owner, name, counted)


def _quantize_counting(monkeypatch: pytest.MonkeyPatch, points: list[tuple[object, str, bool]],
                       **options) -> dict[str, int]:
    counts: dict[str, int] = {}
    for owner, name, after in points:
        _counting(monkeypatch, owner, name, counts, after=after)
    data = [torch.randn(8, WIDTH) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp.quantize(_counted_mlp(), (data[0],), data, backend="fbgemm", **options)
    return counts


def test_quantize_holds_one_float_copy_of_each_weight_while_it_calibrates(monkeypatch: pytest.MonkeyPatch):
    from qplug_core.flows import steps

    # the user's weight and the observed model's, as calibration ends with bias correction's meters
    # still on; they held W_q - W of every layer besides (3)
    assert _quantize_counting(monkeypatch, [(steps, "calibrate", True)]) == {"calibrate": 2}


def test_lowering_keeps_no_rounded_float_copy_of_a_layer_it_replaced(monkeypatch: pytest.MonkeyPatch):
    from qplug_core.flows import finish

    # the user's weight alone once every layer runs its kernel: the reference form kept for qp.save
    # holds each one as int8 from the moment its kernel replaced it; it held the rounded float copy
    # until lowering ended, beside every packed kernel and then every int8 copy (2)
    assert _quantize_counting(monkeypatch, [(finish, "lower_graph", True)]) == {"lower_graph": 1}


def test_a_target_search_holds_one_float_copy_of_each_weight_besides_the_rounded_one(
        monkeypatch: pytest.MonkeyPatch):
    from qplug_core.flows import finish, steps

    layer_errors = importlib.import_module("qplug_core.algorithms.layer_errors")  # the package names a function so
    counts = _quantize_counting(monkeypatch, [(steps, "finish_conversion", False),  # converted, not lowered
                                              (finish, "lower_graph", True),  # lowered
                                              (layer_errors, "float_output", False)],  # the layer errors
                                target=qp.Target(cosine=0.9))
    # the user's, the fused float graph's (the calibrated model shares it) and, once converted, the
    # rounded one, until its layer is lowered; each observed model, converted copy and weight grid
    # held one more (4, 7), and the rounded copy stayed until lowering ended (3)
    assert counts == {"finish_conversion": 3, "lower_graph": 2, "float_output": 2}

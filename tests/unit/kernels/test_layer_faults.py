"""A module-swapped model's failed call names the layer and the input at fault, and raises the float
model's builtin error type too (``qplug_core/kernels/layer_faults.py``).

``qp.quantize_dynamic`` / ``qp.quantize_weights`` models handed back fbgemm's, torch's or ONNX
Runtime's messages naming no layer, and qplug's own refusals escaped ``except RuntimeError``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.registry import plugins

pytestmark = pytest.mark.usefixtures("plugin_autoload")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.bag = nn.EmbeddingBag(50, 16, mode="sum")
        self.enc = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.cell = nn.GRUCell(16, 16)


@pytest.fixture(scope="module")
def float_net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _raised(call) -> Exception:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def _check(float_call, int8_call, layer: str, says: str) -> None:
    """The int8 call raises InputMismatchError naming ``layer`` and saying ``says``, also of the
    builtin type the float call raises."""
    builtin = type(_raised(float_call))
    error = _raised(int8_call)
    assert isinstance(error, InputMismatchError) and isinstance(error, builtin), type(error).__mro__
    assert f"layer {layer!r}" in str(error) and says in str(error)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack", "reference"])
def test_a_wrong_feature_size_names_the_dynamic_layer(float_net, backend):
    int8 = qp.quantize_dynamic(float_net, backend=backend)
    x = torch.randn(2, 12)
    _check(lambda: float_net.enc(x), lambda: int8.enc(x), "enc.0", "takes inputs with 16 features")
    _check(lambda: float_net.lstm(torch.randn(2, 5, 12)), lambda: int8.lstm(torch.randn(2, 5, 12)), "lstm",
           "got shape (2, 5, 12)")
    _check(lambda: float_net.cell(x), lambda: int8.cell(x), "cell", "16 features")


def test_a_float64_input_names_the_dynamic_layer_as_the_float_one_refuses_it(float_net):
    int8 = qp.quantize_dynamic(float_net, backend="fbgemm")
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    _check(lambda: float_net.lstm(x), lambda: int8.lstm(x), "lstm", "float32 inputs, got float64")  # ValueError
    _check(lambda: float_net.enc(x), lambda: int8.enc(x), "enc.0", "float32 inputs, got float64")  # RuntimeError


def test_a_per_token_layer_given_a_wrong_feature_size_is_named(float_net):
    int8 = qp.quantize_dynamic(float_net, backend="fbgemm", per_token=True)
    _check(lambda: float_net.enc(torch.randn(3, 8)), lambda: int8.enc(torch.randn(3, 8)), "enc.0",
           "16 features")


@pytest.mark.parametrize("bits, kernel", [(8, "torch-int8pack"), (4, "reference")])
def test_an_id_outside_a_weight_only_table_names_it_as_the_float_table_fails(float_net, bits, kernel):
    """The float table raises IndexError, the float bag RuntimeError: so do ours, naming the layer
    (the kernel is forced: measuring them is not the point here)."""
    int8 = qp.quantize_weights(float_net, bits=bits, embeddings=True, kernel=kernel)
    ids = torch.tensor([[1, 2, 60]])
    _check(lambda: float_net.emb(ids), lambda: int8.emb(ids), "emb", "ids from 1 to 60, but its table has 50 rows")
    _check(lambda: float_net.bag(ids), lambda: int8.bag(ids), "bag", "ids from 1 to 60")
    minus = torch.tensor([3, -1])
    _check(lambda: float_net.emb(minus), lambda: int8.emb(minus), "emb", "ids from -1 to 3")
    x = torch.randn(2, 12)
    _check(lambda: float_net.enc(x), lambda: int8.enc(x), "enc.0", "16 features")


def test_a_saved_and_loaded_dynamic_model_still_names_its_layers(float_net, tmp_path):
    int8 = qp.quantize_dynamic(float_net, backend="fbgemm")
    qp.save(int8, tmp_path / "m.qplug")
    loaded = qp.load(tmp_path / "m.qplug", model=Net().eval())
    with pytest.raises(RuntimeError, match=r"layer 'enc\.0' \(DynamicLinear\)"):
        loaded.enc(torch.randn(2, 12))


def test_refusals_the_float_model_does_not_share_keep_their_type_and_gain_the_name(float_net):
    """NaN: the float layer answers NaN, so qplug's refusal stays of its own type only; a layer built
    on its own has no name to give, and says its class."""
    int8 = qp.quantize_dynamic(float_net, backend="fbgemm")
    error = _raised(lambda: int8.enc(torch.full((2, 16), float("nan"))))
    assert type(error) is InputMismatchError and "layer 'enc.0' (DynamicLinear): " in str(error)
    assert "NaN" in str(error)
    alone = type(int8.enc[0]).from_float(nn.Linear(16, 4))
    with pytest.raises(RuntimeError, match=r"^DynamicLinear: int8 DynamicLinear takes inputs with 16"):
        alone(torch.randn(2, 3))


def test_the_error_crosses_to_a_process_that_never_made_its_class(float_net):
    """A worker pool's parent unpickles the worker's error: the class made for the builtin type is
    found by name there too (it was a class pickle could not find: ``MaybeEncodingError``)."""
    import pickle
    import subprocess
    import sys

    int8 = qp.quantize_dynamic(float_net, backend="fbgemm")
    error = _raised(lambda: int8.enc(torch.randn(2, 12)))
    read = ("import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
            "from qplug_core.errors import InputMismatchError; "
            "print(isinstance(e, InputMismatchError), isinstance(e, RuntimeError), e.layer, str(e) == sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", read, str(error)], input=pickle.dumps(error),
                          capture_output=True, check=True)
    assert done.stdout.decode().split() == ["True", "True", "enc.0", "True"], done.stderr.decode()[-500:]


@pytest.fixture(scope="module")
def other_dtype_takers(float_net) -> dict[str, Net]:
    """The layers that took inputs of another dtype than float32 (per-token and reference dynamic
    computed in float32, weight-only on ONNX Runtime cast to float32, its reference kernel computed
    in the input's dtype) where the float model refuses them. Every plugin loaded as
    ``plugin_autoload`` loads them (a function fixture, set up after this module one)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(plugins.ENV_LOAD, raising=False)
        plugins.reset()
        return {"per-token": qp.quantize_dynamic(float_net, backend="fbgemm", per_token=True),
                "reference dynamic": qp.quantize_dynamic(float_net, backend="reference"),
                **{f"weight-only {kernel}": qp.quantize_weights(float_net, bits=4, kernel=kernel)
                   for kernel in ("reference", "onnxruntime-matmulnbits")}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_an_input_of_another_dtype_is_refused_naming_the_layer_as_the_float_one_refuses_it(
        float_net, other_dtype_takers, dtype):
    x = torch.randn(2, 16).to(dtype)
    says = f"takes float32 inputs, got {str(dtype).removeprefix('torch.')} of shape (2, 16)"
    for int8 in other_dtype_takers.values():
        _check(lambda: float_net.enc(x), lambda: int8.enc(x), "enc.0", says)  # RuntimeError
    sequence = torch.randn(2, 5, 16).to(dtype)
    int8 = other_dtype_takers["reference dynamic"]
    _check(lambda: float_net.lstm(sequence), lambda: int8.lstm(sequence), "lstm", "takes float32 inputs")  # ValueError


def test_a_weight_only_layer_takes_the_dtype_its_float_layer_computed_in(float_net):
    """A bfloat16 model's layers take bfloat16 and refuse float32; under autocast the float layer
    takes another dtype, and so do they."""
    bf16 = qp.quantize_weights(copy.deepcopy(float_net).bfloat16(), bits=4, kernel="reference")
    assert bf16.enc(torch.randn(2, 16).bfloat16()).dtype == torch.bfloat16
    x = torch.randn(2, 16)
    _check(lambda: copy.deepcopy(float_net).bfloat16().enc(x), lambda: bf16.enc(x), "enc.0",
           "takes bfloat16 inputs, got float32")
    int4 = qp.quantize_weights(float_net, bits=4, kernel="onnxruntime-matmulnbits")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert int4.enc(torch.randn(2, 16).bfloat16()).shape == (2, 16)


def test_ids_of_a_float_dtype_name_the_weight_only_table_as_the_float_table_refuses_them(float_net):
    int8 = qp.quantize_weights(float_net, bits=4, embeddings=True, kernel="reference")
    ids = torch.tensor([[1.0, 2.0]])
    _check(lambda: float_net.emb(ids), lambda: int8.emb(ids), "emb", "takes int64 or int32 ids, got float32")
    _check(lambda: float_net.bag(ids), lambda: int8.bag(ids), "bag", "takes int64 or int32 ids, got float32")

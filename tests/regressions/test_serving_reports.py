"""Shipping a converted model the torch way (MLOps report s24, F1/F2/F11): pickle, state_dict,
torch.jit.script / trace, torch.export and torch.compile either work or raise a qplug error that
says what to do instead (docs/guide/static-ptq.md, "Running and shipping")."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ModelStateError, SerializationError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@functools.cache  # the tests only read the model: one quantization per backend
def _graph_model(backend: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, 1, 8, 8)
    return qp.quantize(_Cnn().eval(), (x,), [(torch.randn(8, 1, 8, 8),)], backend=backend), x


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


SWAPPED = {
    "dynamic": lambda: qp.quantize_dynamic(_mlp(), backend="fbgemm"),
    "per_token": lambda: qp.quantize_dynamic(_mlp(), backend="fbgemm", per_token=True),
    "w8a8": lambda: qp.quantize_w8a8(_mlp(), [torch.randn(4, 32)]),
    "weight_only_int4_ort": lambda: qp.quantize_weights(_mlp(), bits=4, group_size=32,
                                                        kernel="onnxruntime-matmulnbits"),
}


SCRIPT_REFUSED = r"torch.jit.script cannot compile a qplug int8 model.*qp\.save.*qp\.export_onnx"
STATE_DICT_SAYS = "holds no int8 weights"


@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
def test_jit_script_of_a_converted_model_says_what_ships_it(backend):
    """It raised "'_EnterEngine' object has no attribute '__name__'" (fbgemm)."""
    model, _ = _graph_model(backend)
    with pytest.raises(ModelStateError, match=SCRIPT_REFUSED):
        torch.jit.script(model)


@pytest.mark.parametrize("backend, warns", [("fbgemm", True), ("reference", False)])
def test_a_state_dict_without_the_int8_weights_says_so_once(backend, warns, tmp_path):
    """``torch.save(model.state_dict())`` of an fbgemm model wrote an empty file without a word;
    the reference form's state_dict holds its weights and stays quiet."""
    model, _ = _graph_model(backend)
    assert len(_state_dict_warnings(model)) == (1 if warns else 0)  # once for the model, not per layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # qp.save reads no state_dict of the int8 layers
        qp.save(model, tmp_path / "m.safetensors")


@pytest.mark.slow  # quantizing for onnxruntime builds and checks sessions: ~5 s
def test_an_onnxruntime_model_refuses_script_and_export_and_its_state_dict_says_so():
    """jit.script's message held the partition's serialized ONNX bytes; torch.export raised
    ".numpy() is not supported for tensor subclasses"; state_dict() was silently empty."""
    model, x = _graph_model("onnxruntime")
    with pytest.raises(ModelStateError, match=SCRIPT_REFUSED) as info:
        torch.jit.script(model)
    assert "\\x" not in str(info.value)
    with pytest.raises(ModelStateError, match=r"torch.export cannot capture a partition compiled by "
                                              r"OrtPartition.*Export the float model.*qp\.export_program\(model"):
        torch.export.export(model, (x,))
    said = _state_dict_warnings(model)
    assert len(said) == 1 and "qp.save" in said[0]


def _state_dict_warnings(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.state_dict()
    return [str(w.message) for w in caught if STATE_DICT_SAYS in str(w.message)]


@pytest.mark.parametrize("mode", list(SWAPPED))
def test_module_swap_models_refuse_pickle_and_jit_script_and_deep_copy(mode):
    """Pickling a quantize_dynamic model crashed on a lambda while the other module-swap models
    pickled (and carried kernels chosen for this CPU into the file): all refuse, as graph models do."""
    model = SWAPPED[mode]()
    x = torch.randn(3, 32)
    with pytest.raises(SerializationError, match=r"cannot be pickled.*qp\.load\(path, model=float_model\)"):
        pickle.dumps(model)
    with pytest.raises(SerializationError, match="cannot be pickled"):
        torch.save(model, io.BytesIO())
    with pytest.raises(ModelStateError, match=SCRIPT_REFUSED):
        torch.jit.script(model)
    assert torch.equal(copy.deepcopy(model)(x), model(x))


@pytest.mark.parametrize("mode", ["per_token", "w8a8", "weight_only_int4_ort"])
def test_module_swap_models_torch_export_says_what_ships_them(mode):
    """Raw "Cannot access data pointer of Tensor (e.g. FakeTensor...)" (per-token kernels) or
    ".numpy() is not supported for tensor subclasses" (ONNX Runtime's MatMulNBits)."""
    model = SWAPPED[mode]()
    with pytest.raises(ModelStateError, match=r"torch.export cannot capture .*Export the float model"):
        torch.export.export(model, (torch.randn(3, 32),))


def test_a_dynamic_lstm_refuses_torch_export():
    """Never a graph that answers for the example only. Its packed cells are module attributes (so
    torch.jit.trace reaches them, for the lite interpreter), which torch.export fakes before any
    forward runs and fails on inside torch (torch's packed RNN cells have no fake class): qplug's own
    refusal, raised from the layer's forward, is not reached there."""
    model = qp.quantize_dynamic(nn.Sequential(nn.LSTM(8, 8, batch_first=True)).eval(), backend="fbgemm")
    with pytest.raises((ModelStateError, AttributeError), match="torch.export cannot capture the dynamic int8 "
                                                                "layer DynamicLSTM|CellParamsBase"):
        torch.export.export(model, (torch.randn(2, 3, 8),))


@pytest.mark.parametrize("mode", ["per_token", "w8a8"])
def test_jit_trace_of_a_per_token_model_says_why(mode):
    """It raised "RuntimeError: Unsupported value kind: Tensor"."""
    with pytest.raises(ModelStateError, match=r"torch.jit.trace cannot record PerTokenDynamicLinear: it "
                                              r"reuses per-thread buffers"):
        torch.jit.trace(SWAPPED[mode](), (torch.randn(3, 32),))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_jit_trace_of_a_kernel_model_records_it_without_tracer_warnings(backend):
    """The int8 layers' input-size check turned traced sizes into Python bools: 8 TracerWarnings
    ("might cause the trace to be incorrect") on the digits CNN, which made users doubt the trace."""
    model, x = _graph_model(backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (x,))
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    other = torch.randn(5, 1, 8, 8)
    assert torch.equal(traced(other), model(other))


def test_a_dynamic_model_state_dict_says_where_its_weights_are(tmp_path):
    model = SWAPPED["dynamic"]()
    assert len(_state_dict_warnings(model)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp.load(qp.save(model, tmp_path / "m.safetensors"), model=_mlp())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_token", "w8a8"])
def test_torch_compile_of_a_per_token_model_answers_as_eager(mode):
    """Inductor failed inside the per-token kernel with "InductorError: AssertionError:" (no message);
    the layer now runs eagerly between compiled graphs."""
    torch._dynamo.reset()
    model = SWAPPED[mode]()
    compiled = torch.compile(model)
    for x in (torch.randn(3, 32), torch.randn(1, 5, 32)):
        assert torch.equal(compiled(x), model(x))

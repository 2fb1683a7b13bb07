"""Misusing the API gets qplug's own errors, never an AttributeError, TypeError or RecursionError
from inside, and never a silently wrong model (issue 17)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.config import QConfig, QConfigMapping
from qplug_core.errors import (
    CalibrationError,
    ConfigError,
    ConfigValidationError,
    InputMismatchError,
    ModelStateError,
)
from qplug_core.observers import HistogramObserver, MinMaxObserver

BACKEND = "reference"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
DATA = [(X,)]


@pytest.mark.parametrize("model, fragment", [
    (None, "got None (NoneType)"),
    ("resnet18", "got 'resnet18' (str)"),
    (lambda x: x, "got the function '<lambda>'"),
    (Net, "got the class Net; pass an instance: Net(...)"),
], ids=["none", "str", "lambda", "class"])
def test_quantize_something_that_is_not_a_model(model, fragment):
    with pytest.raises(ConfigValidationError, match="model must be a torch.nn.Module") as raised:
        qp.quantize(model, X, DATA, backend=BACKEND)
    assert fragment in str(raised.value) and raised.value.field == "model"


@pytest.mark.parametrize("call", [
    lambda m: qp.quantize_weights(m),
    lambda m: qp.quantize_w8a8(m, alpha=None),
    lambda m: qp.quantize_dynamic(m),
    lambda m: qp.quantize_dynamic(m, backend="onnxruntime", example_inputs=(X,)),  # a delegate
    lambda m: qp.eager.fuse_modules(m, [["fc"]]),
    lambda m: qp.eager.prepare(m),
], ids=["quantize_weights", "quantize_w8a8", "quantize_dynamic", "quantize_dynamic_onnxruntime",
        "eager_fuse", "eager_prepare"])
def test_every_entry_point_refuses_a_non_model_as_quantize_does(call):
    with pytest.raises(ConfigValidationError, match=r"model must be a torch.nn.Module: got 'resnet18' \(str\)"):
        call("resnet18")


def test_compare_and_sqnr_refuse_what_is_not_a_model_or_a_tensor():
    with pytest.raises(ConfigValidationError, match="float_model must be a torch.nn.Module: got 'a'") as raised:
        qp.compare("a", net(), [X])
    assert raised.value.field == "float_model"
    with pytest.raises(ConfigValidationError, match="quantized_model must be a torch.nn.Module: got 'b'"):
        qp.compare(net(), "b", [X])
    with pytest.raises(ConfigValidationError, match="sqnr: reference must be a torch.Tensor, got list"):
        qp.sqnr([1.0], torch.ones(1))


def test_quantize_weights_takes_a_backend_object_as_its_siblings_do():
    qmodel = qp.quantize_weights(net(), backend=qp.get_backend(BACKEND))
    assert set(qmodel.qplug_weight_only.layers) == {"fc", "head"}


@pytest.mark.parametrize("call", [
    lambda data: qp.quantize_weights(net(), algorithm="awq", calibration_data=data),
    lambda data: qp.quantize_w8a8(net(), data),
], ids=["quantize_weights", "quantize_w8a8"])
def test_swap_flows_refuse_calibration_that_is_not_batches(call):
    with pytest.raises(CalibrationError, match="calibration must be an iterable of batches .* got 5 \\(int\\)"):
        call(5)


@pytest.mark.parametrize("data", [5, 3.5, "batches.npy", None], ids=["int", "float", "str", "none"])
def test_calibration_data_that_is_not_batches(data):
    model = net()
    with pytest.raises(CalibrationError, match="calibration_data must be an iterable of batches"):
        qp.quantize(model, X, data, backend=BACKEND)


def test_calibrate_on_a_float_model_is_refused():
    with pytest.raises(ModelStateError, match="this Net has no observers, so calibrating it records "
                                              "nothing; prepare it first with qp.prepare_fx"):
        qp.calibrate(net(), DATA)


def test_convert_after_a_calibration_that_raised_is_refused():
    observed = qp.prepare_fx(net(), None, X, backend=BACKEND)
    qp.calibrate(observed, DATA)
    with pytest.raises(InputMismatchError):
        qp.calibrate(observed, [(torch.randn(2, 3),)])  # wrong width: fc raises after input observer ran
    with pytest.raises(CalibrationError, match=r"a calibration of this model raised \(RuntimeError: "
                                               r"mat1 and mat2 shapes cannot be multiplied.*Prepare "
                                               r"the float model again"):
        qp.convert_fx(observed)
    with pytest.raises(CalibrationError, match="a calibration of this model raised"):
        qp.convert_to_reference_fx(observed)
    # a fresh preparation is fine
    fresh = qp.calibrate(qp.prepare_fx(net(), None, X, backend=BACKEND), DATA)
    assert qp.quantization_report(qp.convert_fx(fresh)).quantized


def test_quantizing_an_already_quantized_model_is_refused():
    quantized = qp.quantize(net(), X, DATA, backend=BACKEND)
    with pytest.raises(ModelStateError, match="this model is already quantized .it holds x_quantize_0, .*; quantize the original float model"):
        qp.quantize(quantized, X, DATA, backend=BACKEND)
    with pytest.raises(ModelStateError, match="already quantized"):
        qp.prepare_fx(quantized, None, X, backend=BACKEND)


@pytest.mark.parametrize("prepare", [qp.prepare_fx, qp.prepare_qat_fx], ids=["ptq", "qat"])
def test_quantizing_an_already_observed_model_is_refused(prepare):
    observed = prepare(net(), None, X, backend=BACKEND)
    with pytest.raises(ModelStateError, match="this model is already prepared .it holds .*; calibrate "
                                              "it with qp.calibrate and convert it with qp.convert_fx"):
        qp.quantize(observed, X, DATA, backend=BACKEND)
    with pytest.raises(ModelStateError, match="already prepared"):
        qp.prepare_fx(observed, None, X, backend=BACKEND)


def test_qconfig_whose_kwargs_contain_themselves():
    loop: dict = {}
    loop["again"] = loop
    with pytest.raises(ConfigValidationError, match=r"MinMaxObserver.with_args.eps.again: the keyword "
                                                    r"arguments contain themselves"):
        MinMaxObserver.with_args(eps=loop)
    # edited into a cycle after construction: to_dict says so instead of recursing
    factory = MinMaxObserver.with_args()
    qconfig = QConfig(activation=factory, weight=None)
    cycle: list = []
    cycle.append(cycle)
    factory.kwargs["eps"] = cycle
    with pytest.raises(ConfigValidationError, match=r"activation.eps\[0\]: the keyword arguments "
                                                    r"contain themselves"):
        qconfig.to_dict()
    with pytest.raises(ConfigValidationError, match="contain themselves"):
        QConfigMapping().set_global(qconfig).to_dict()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"eps": "tiny"}, "eps must be a finite number in [1.175e-38, 0.001], got 'tiny'"),
    ({"bins": "many"}, "bins must be an int in [1, 65536], got 'many'"),
    ({"dtype": 5}, "quantized dtype 5 is not supported"),
    ({"averaging_constant": 0.1}, "unexpected keyword argument 'averaging_constant'"),
], ids=["eps-str", "bins-str", "dtype-int", "unknown-kwarg"])
def test_observer_kwargs_of_the_wrong_type_in_a_document(kwargs, fragment):
    document = QConfig(activation=HistogramObserver, weight=None).to_dict()
    document["activation"]["kwargs"].update(kwargs)
    with pytest.raises(ConfigError, match="activation") as raised:
        QConfig.from_dict(document)
    assert fragment in str(raised.value)
    mapping_doc = QConfigMapping().set_global(QConfig(activation=HistogramObserver)).to_dict()
    mapping_doc["global"]["activation"]["kwargs"].update(kwargs)
    with pytest.raises(ConfigError, match=r"global.activation"):
        QConfigMapping.from_dict(mapping_doc)


def test_set_module_name_naming_a_fused_away_module_warns_where_to_set_it():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    mapping = qp.get_default_qconfig_mapping(BACKEND).set_module_name("2", None)
    with pytest.warns(UserWarning, match=re.escape("QConfigMapping names module '2', which fusion merged into "
                                                   "'0' (ConvReLU2d); a fused module follows the rules for its "
                                                   "own name, so this setting is ignored")):
        qp.prepare_fx(model, mapping, (torch.randn(1, 3, 6, 6),), backend=BACKEND)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fused module's own name: no warning
        qp.prepare_fx(model, qp.get_default_qconfig_mapping(BACKEND).set_module_name("0", None),
                      (torch.randn(1, 3, 6, 6),), backend=BACKEND)


def test_set_module_name_naming_a_missing_module_warns_with_the_close_match():
    mapping = qp.get_default_qconfig_mapping(BACKEND).set_module_name("fcc", None)
    with pytest.warns(UserWarning, match=re.escape("QConfigMapping names module 'fcc', which this Net "
                                                   "does not have (did you mean 'fc'?); that setting "
                                                   "is ignored")) as caught:
        observed = qp.prepare_fx(net(), mapping, X, backend=BACKEND)
    assert caught[0].filename == __file__  # points at the user's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an existing name: no warning
        qp.prepare_fx(net(), qp.get_default_qconfig_mapping(BACKEND).set_module_name("fc", None), X,
                      backend=BACKEND)
    assert observed is not None

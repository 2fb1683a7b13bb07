"""Bad inputs to the graph-mode flows (reliability.md B5 rows 11, 12, 17, 18, 23-27, 34 and the
device / train-mode / input-mismatch faults): each gives the project's own error type and a message
saying what failed, where, and the fix."""

from __future__ import annotations

import platform
import warnings

import pytest
import torch
from faultkit import conv_net, images
from torch import nn

import qplug_core as qp
from qplug_core import plugin_api
from qplug_core.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    CalibrationError,
    ConfigValidationError,
    ConstraintViolationError,
    InputMismatchError,
    ModelStateError,
    NonFiniteCalibrationError,
    NothingQuantizedError,
    TraceError,
    UncalibratedObserverError,
)
from qplug_core.nn import qat
from qplug_core.observers import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

pytestmark = pytest.mark.usefixtures("installed_backends")

X = images(1)[0]


# -- backends (rows 11, 12) ------------------------------------------------------------------------


def test_unknown_backend_suggests_the_near_miss():
    with pytest.raises(BackendNotFoundError) as raised:
        qp.quantize(conv_net(), X, images(), backend="qnnpak")
    message = str(raised.value)
    assert "no backend 'qnnpak' (did you mean 'qnnpack'?)" in message
    assert "installed backends: reference, " in message  # the list to choose from
    assert raised.value.backend == "qnnpak"


def test_engine_missing_from_this_torch_build(monkeypatch):
    """Row 11 with the real fbgemm plugin: the probe reads supported_engines, so fake that list."""
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack", "none"])
    status = {info.name: info.status for info in qp.list_backends()}
    assert status["fbgemm"] == "unavailable" and status["qnnpack"] == "ok"
    with pytest.raises(BackendUnavailableError) as raised:
        qp.quantize(conv_net(), X, images(), backend="fbgemm")
    message = str(raised.value)
    assert "backend 'fbgemm' cannot run on this machine" in message
    assert "engine 'fbgemm' not in torch.backends.quantized.supported_engines" in message
    assert platform.machine() in message and "use one of: reference, qnnpack" in message
    qp.quantize(conv_net(), X, images(1), backend="qnnpack")  # the other backend is unaffected


def test_model_on_the_meta_device_is_refused_before_any_backend_check():
    """Meta tensors hold no values: moving them to the CPU (the device check's advice) cannot help."""
    model = conv_net().to("meta")
    with pytest.raises(ModelStateError) as raised:
        qp.prepare_fx(model, None, (X[0].to("meta"),), backend="fbgemm")
    assert "the model has tensors on the meta device, which hold no values" in str(raised.value)
    assert "model.to_empty(device='cpu')" in str(raised.value) and "model.cpu()" not in str(raised.value)


# -- qconfigs the backend cannot honour (row 17) ---------------------------------------------------


def _full_range_weights_mapping() -> qp.QConfigMapping:
    """Every scale bound of qnnpack met (eps = 2^-12), but weights in [-128, 127], not [-127, 127]."""
    eps = 2.0 ** -12
    return qp.QConfigMapping().set_global(qp.QConfig(
        activation=HistogramObserver.with_args(eps=eps),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric,
                                        quant_min=-128, quant_max=127, eps=eps)))


def test_qconfig_outside_qnnpack_constraints_warns_and_falls_back_to_float():
    with pytest.warns(UserWarning, match=r"ConvReLU2d at node 'conv' stays float: the backend cannot "
                                         r"honour the qconfig: weight: quant range \(-128, 127\) must "
                                         r"fall within the backend's \(-127, 127\).*Use the backend's "
                                         r"default qconfig mapping"):
        observed = qp.prepare_fx(conv_net(), _full_range_weights_mapping(), X, backend="qnnpack")
    qp.calibrate(observed, images())
    with pytest.raises(NothingQuantizedError, match=r"0 int8 regions.*\(-127, 127\)") as raised:
        qp.convert_fx(observed)  # every op fell back: a float result must not pass silently
    assert "(-127, 127)" in raised.value.reasons[0][0]
    report = qp.quantization_report(qp.convert_fx(observed, allow_float=True))
    skipped = {s.node: s.reason for s in report.skipped}
    assert "conv" not in report.kernels and "(-127, 127)" in skipped["conv"]


def test_qp_quantize_with_a_recipe_keeps_allow_float_and_the_float_bias():
    # bias correction measured each layer for the mapping's int8 weights; convert left them all
    # float, so they must come back with their float biases, and allow_float=True must be honoured
    model = conv_net()
    options = dict(backend="qnnpack", qconfig_mapping=_full_range_weights_mapping(), recipe="bias_correction")
    with pytest.warns(UserWarning, match="stays float"), pytest.raises(NothingQuantizedError):
        qp.quantize(model, X, images(), **options)
    with pytest.warns(UserWarning, match="stays float"):
        qmodel = qp.quantize(model, X, images(), allow_float=True, **options)
    assert qp.quantization_report(qmodel).quantized == {}
    fused = qp.fuse_fx(model, X, backend="qnnpack")
    with torch.no_grad():
        assert torch.equal(qmodel(*X), fused(*X))


def test_qconfig_outside_qnnpack_constraints_raises_on_request():
    with pytest.raises(ConstraintViolationError, match=r"node 'conv' stays float.*\(-127, 127\)") as raised:
        qp.prepare_fx(conv_net(), _full_range_weights_mapping(), X, backend="qnnpack",
                      on_unsupported="raise")
    assert raised.value.field == "conv"


def test_qconfig_outside_constraints_skip_records_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        observed = qp.prepare_fx(conv_net(), _full_range_weights_mapping(), X, backend="qnnpack",
                                 on_unsupported="skip")
    qp.calibrate(observed, images(1))
    report = qp.quantization_report(qp.convert_fx(observed, allow_float=True))
    assert "conv" in {s.node for s in report.skipped}


# -- tracing (row 18) ------------------------------------------------------------------------------


class DataDependentGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.gate = DataDependentGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.pre(x))


def test_untraceable_submodule_is_named_with_both_ways_out():
    x = torch.randn(2, 4)
    with pytest.raises(TraceError) as raised:
        qp.prepare_fx(GatedNet().eval(), None, (x,), backend="fbgemm", capture="symbolic")
    message = str(raised.value)
    assert "cannot trace submodule 'gate' (DataDependentGate)" in message
    assert "non_traceable_module_names=['gate']" in message and "qp.eager" in message
    assert raised.value.module == "gate"
    # the first way out works: the gate stays an opaque float module, the rest is quantized
    observed = qp.prepare_fx(GatedNet().eval(), None, (x,), backend="fbgemm",
                             non_traceable_module_names=["gate"])
    qp.calibrate(observed, [x])
    report = qp.quantization_report(qp.convert_fx(observed))
    assert "pre" in report.kernels and "gate" in {s.node for s in report.skipped}


def test_value_dependent_submodule_stays_float_by_default_and_is_reported():
    # neither symbolic tracing nor torch.export captures the gate's `if` on a tensor's value:
    # by default the gate stays an opaque float module, named in the report with the reason
    x = torch.randn(2, 4)
    model = GatedNet().eval()
    observed = qp.prepare_fx(model, None, (x,), backend="fbgemm")
    qp.calibrate(observed, [x])
    quantized = qp.convert_fx(observed)
    report = qp.quantization_report(quantized)
    reasons = {s.node: s.reason for s in report.skipped}
    assert "pre" in report.kernels and report.capture == "symbolic"
    assert reasons["gate"].startswith("capture failed: torch.export could not capture") and "symbolic tracing:" in reasons["gate"]
    assert torch.allclose(quantized(x), model(x), atol=0.05)


# -- calibration (rows 23-27) ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_non_finite_calibration_data_names_the_layer(bad):
    batch = X[0].clone()
    batch[0, 0, 0, :3] = bad
    with pytest.raises(NonFiniteCalibrationError) as raised:
        qp.quantize(conv_net(), X, [X, (batch,)], backend="fbgemm")
    assert "\"input of node 'x'\" received 3 non-finite value(s)" in str(raised.value)
    assert "fix the data or model, or build the observer with nonfinite='ignore'" in str(raised.value)
    assert (raised.value.node, raised.value.count) == ("input of node 'x'", 3)


def test_non_finite_activation_inside_the_model_names_that_layer():
    model = conv_net()
    with torch.no_grad():  # finite weights whose products overflow float32
        model.fc.weight[1] = 3e38
    with pytest.raises(NonFiniteCalibrationError, match="output of node 'fc'.*non-finite"):
        qp.quantize(model, X, images(), backend="fbgemm")


def test_a_non_finite_weight_names_the_parameter_before_anything_runs():
    model = conv_net()
    with torch.no_grad():
        model.fc.bias[1] = float("inf")
    with pytest.raises(ModelStateError, match=r"non-finite values \(NaN or Inf\) in 'fc.bias' \(1 of \d+\)"):
        qp.quantize(model, X, images(), backend="fbgemm")


def test_values_near_float_max_give_a_non_finite_scale_error():
    """Row 24: +-3.4e38 in one batch: max - min overflows float32, so the scale would be inf."""
    batch = X[0].clone()
    batch[0, 0, 0, 0], batch[0, 0, 0, 1] = 3.4e38, -3.4e38
    with pytest.raises(NonFiniteCalibrationError, match="input of node 'x'.*non-finite scale"):
        qp.quantize(conv_net(), X, [(batch,)], backend="fbgemm")


@pytest.mark.parametrize("data, message", [
    ([], r"calibration_data gave no batch \(an empty list, or a generator or iterator already used up"),
    (iter([]), r"calibration_data gave no batch"),
    ([(torch.empty(0, 3, 8, 8),)] * 2,
     r"0 batches observed \(2 given, all empty\): calibration needs at least one batch")],
    ids=["no-batches", "spent-iterator", "all-empty-batches"])
def test_empty_calibration_set(data, message):
    with pytest.raises(CalibrationError, match=message):
        qp.quantize(conv_net(), X, data, backend="fbgemm")


def test_empty_batches_are_skipped_among_good_ones():
    empty = (torch.empty(0, 3, 8, 8),)
    with_empty = qp.quantize(conv_net(), X, [empty, *images(2), empty], backend="reference")
    without = qp.quantize(conv_net(), X, images(2), backend="reference")
    assert torch.equal(with_empty(X[0]), without(X[0]))


class _Stream(torch.utils.data.IterableDataset):
    """Batches read as a stream (a Hugging Face streaming dataset): it has no length."""

    def __iter__(self):
        return iter(images(2))


def test_a_dataloader_of_a_stream_calibrates_as_a_list_of_its_batches():
    """A DataLoader of an IterableDataset defines ``__len__`` and raises TypeError: calibration asked
    it for the progress bar's total and failed with that TypeError, "object of type '_Stream' has no len()"."""
    streamed = qp.quantize(conv_net(), X, torch.utils.data.DataLoader(_Stream(), batch_size=None), backend="reference")
    listed = qp.quantize(conv_net(), X, images(2), backend="reference")
    assert torch.equal(streamed(X[0]), listed(X[0]))

def test_convert_before_calibration_lists_the_observers():
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    with pytest.raises(UncalibratedObserverError) as raised:
        qp.convert_fx(observed)
    assert "never saw calibration data: input of node 'x'" in str(raised.value)
    assert "qp.calibrate" in str(raised.value) and "allow_uncalibrated=True" in str(raised.value)
    assert "input of node 'x'" in raised.value.nodes and len(raised.value.nodes) >= 3


class Router(nn.Module):
    """Rows where feature 0 is positive go to ``a``, the others to ``b`` (a mixture-of-experts gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        gate = x[:, 0] > 0
        return self.a(x[gate]), self.b(x[~gate])


@pytest.mark.parametrize("flags", ["avx2 fma", "avx2 fma avx512f avx512bw avx512_vnni"],
                         ids=["no-vnni", "vnni"])  # without VNNI convert also chooses weight bits
def test_unused_branch_is_named_and_can_be_left_float(flags):
    torch.manual_seed(0)
    model, x = Router().eval(), torch.randn(8, 4)
    with plugin_api.override_cpu_flags(flags):
        observed = qp.prepare_fx(model, None, (x,), backend="fbgemm")
        qp.calibrate(observed, [x.abs()])  # branch b only ever sees empty tensors
        with pytest.raises(UncalibratedObserverError) as raised:
            qp.convert_fx(observed)
        converted = qp.convert_fx(observed, allow_uncalibrated=True)
    assert raised.value.nodes == ("input of node 'getitem_2'", "output of node 'b'")
    assert "2 observer(s) never saw calibration data" in str(raised.value)
    report = qp.quantization_report(converted)
    assert "a" in report.kernels and "b" not in report.kernels
    assert "b" in {s.node for s in report.skipped}
    _, b_out = converted(x)
    assert b_out.dtype == torch.float32  # float activations: no uncalibrated scale=1, zp=0 anywhere
    assert torch.allclose(b_out, model.b(x[x[:, 0] <= 0]), atol=0.02)


# -- inputs that do not fit the model --------------------------------------------------------------


@pytest.mark.parametrize("example, expected", [
    ((torch.randn(2, 5),), r"cannot run on the example inputs \(\(2, 5\)\).*conv2d"),
    ((X[0], X[0]), "2 example inputs given but the model's forward takes 1"),
], ids=["wrong-shape", "too-many"])
def test_example_inputs_that_do_not_fit(example, expected):
    with pytest.raises(InputMismatchError, match=expected):
        qp.prepare_fx(conv_net(), None, example, backend="fbgemm")


@pytest.mark.parametrize("batch", [(torch.randn(2, 5),), (X[0], X[0])], ids=["wrong-shape", "too-many"])
def test_calibration_batch_that_does_not_fit(batch):
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    with pytest.raises(InputMismatchError, match="calibration batch 1 does not fit the model.*same "
                                                 "number, shapes and dtypes of inputs as example_inputs"):
        qp.calibrate(observed, [X, batch])


# -- model state -----------------------------------------------------------------------------------


def test_qat_model_converted_while_training():
    model = conv_net().train()
    qat = qp.prepare_qat_fx(model, None, X, backend="fbgemm")
    for batch in images(2):
        qat(*batch)
    with pytest.raises(ModelStateError, match=r"still in training mode; call model.eval\(\) before "
                                              "converting"):
        qp.convert_fx(qat)
    converted = qp.convert_fx(qat.eval())  # the fix the message gives works
    assert set(qp.quantization_report(converted).kernels) >= {"conv", "fc"}
    assert torch.allclose(converted(X[0]), qat(X[0]), atol=0.05)


def test_qat_module_outside_every_int8_region_becomes_its_float_module(tmp_path):
    """As in torch.ao: a QAT module the mapping leaves float (here a user's own QAT embedding under
    the global qconfig, which embeddings cannot take) converts to its float module, so the float
    region does not keep fake-quantizing its weight and the model saves."""
    embedding = nn.Embedding(10, 8)
    qat_embedding = qat.Embedding.from_float(
        embedding, qp.get_default_qconfig_mapping("fbgemm", "qat").object_type_qconfigs[nn.Embedding])
    model = nn.Sequential(qat_embedding, nn.Linear(8, 3)).train()
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "stays float" for the embedding
        prepared = qp.prepare_qat_fx(model, qp.get_default_qconfig_mapping("fbgemm", "qat"), (ids,),
                                     backend="fbgemm")
    prepared(ids)
    converted = qp.convert_fx(prepared.eval())
    assert type(converted.get_submodule("0")) is nn.Embedding
    assert not any(hasattr(m, "weight_fake_quant") for m in converted.modules())
    torch.testing.assert_close(converted.get_submodule("0")(ids), embedding(ids))
    reloaded = qp.load(qp.save(converted, tmp_path / "model.safetensors"))
    assert torch.equal(reloaded(ids), converted(ids))


# -- per-channel axis (row 34) ---------------------------------------------------------------------


def _weight_axis_mapping(axis: int) -> qp.QConfigMapping:
    return qp.QConfigMapping().set_global(qp.QConfig(
        activation=HistogramObserver,
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                  qscheme=torch.per_channel_symmetric, ch_axis=axis)))


def test_weight_axis_out_of_range_is_reported_at_prepare_with_the_layer():
    with pytest.raises(ConfigValidationError, match=r"layer 'conv'.*ch_axis=5 is out of range for "
                                                    r"its 4-d weight of shape \(4, 3, 3, 3\)"):
        qp.prepare_fx(conv_net(), _weight_axis_mapping(5), X, backend="fbgemm")

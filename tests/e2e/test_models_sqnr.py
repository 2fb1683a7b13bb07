"""Issue 6, graph mode: whole models quantized with the default static config, checked on held-out
inputs against their float originals (output SQNR in dB).

Floors (measured figures in brackets, this repo, torch 2.13, x86 with VNNI):

* ResNet-18 at 224 px: >= 25 dB, the issue's bar [reference 28.7, fbgemm 28.7; torch.ao's fbgemm
  default 25.2 on the same model and inputs]. The bar needs the real resolution: the error of the
  final global average pool shrinks with the number of positions it averages (49 at 224 px, 9 at
  96 px), so at 96-128 px the same flow gives 23-25 dB and torch.ao 20-22.
* MobileNetV2 (depthwise convs, ReLU6) at 112 px: >= 7 dB and at least as good as torch.ao on the same
  backend [reference 9.1, fbgemm 8.1, qnnpack 8.8; torch.ao fbgemm 7.0, qnnpack 5.4]. 25 dB is out of
  reach for *any* int8 tool on this model: with random (kaiming) weights and re-estimated BN
  statistics each of the 17 inverted residuals amplifies the noise of the one before (per-layer SQNR
  falls from ~35 dB at the stem to single digits at the head), torch.ao included. At 224 px the same
  flow gives reference 12.6-13.0, fbgemm 11.9-12.3, qnnpack 12.7-13.3 against torch.ao 11.0-11.5 and
  9.5-10.1 (three model seeds), too slow for this suite.
* BERT-style encoder with trained-BERT outlier channels (make_realistic_bert), masked batches:
  >= 40 dB [46.4 reference and fbgemm]; layer norm and softmax stay float by design.
* LSTM classifier, static: only the Linear head is int8 (nn.LSTM runs dynamic on every backend, so the
  static qconfig cannot apply and it stays float with a reason) [45.2 dB]; dynamic through
  prepare_fx + get_default_qconfig_mapping(mode="dynamic") [fbgemm 43.3 dB with the int8 LSTM kernel].
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model
from qplug_core.zoo.transformer import make_realistic_bert

pytestmark = pytest.mark.usefixtures("one_thread")


def _images(px: int, seed: int, batch: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, px, px, generator=torch.Generator().manual_seed(seed)),)


def _cnn(name: str, px: int):
    """A zoo CNN with BN statistics re-estimated at ``px`` (trained-like activation ranges)."""
    model = get_model(name, seed=0)
    calibrate_batchnorm(model, [_images(px, 100 + s, 8) for s in range(2)])
    calibration = [_images(px, s, 4) for s in range(1, 3)]
    held_out = _images(px, 50, 8)
    with torch.no_grad():
        expected = model(*held_out)
    return model, calibration, held_out, expected


def _qplug_sqnr(model, calibration, held_out, expected, backend: str) -> float:
    quantized = qp.quantize(model, calibration[0], calibration, backend=backend)
    report = qp.quantization_report(quantized)
    # qnnpack's relu6 is wrong on channels_last tensors in torch 2.13, so it runs in reference
    # form until clamps are folded into the producing conv (issue 19, item 18)
    allowed = {"ReLU6"} if backend == "qnnpack" else set()
    assert {s.op for s in report.skipped} <= allowed, report.skipped
    with torch.no_grad():
        return sqnr(expected, quantized(*held_out))


def _torch_ao_sqnr(model, calibration, held_out, expected, backend: str) -> float:
    tq = pytest.importorskip("torch.ao.quantization")
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            observed = quantize_fx.prepare_fx(copy.deepcopy(model), tq.get_default_qconfig_mapping(backend),
                                              calibration[0])
            with torch.no_grad():
                for batch in calibration:
                    observed(*batch)
            quantized = quantize_fx.convert_fx(observed)
            with torch.no_grad():
                return sqnr(expected, quantized(*held_out))
    finally:
        torch.backends.quantized.engine = previous


@pytest.fixture(params=["reference", "fbgemm"])
def backend(request) -> str:
    """The built-in reference backend, and fbgemm (installed plugin, loaded for that test only)."""
    if request.param != "reference":
        request.getfixturevalue("plugin_autoload")
    return request.param


# -- ResNet-18 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet18():
    return _cnn("resnet18", 224)


def test_resnet18_sqnr(resnet18, backend):
    assert _qplug_sqnr(*resnet18, backend) >= 25.0


@pytest.mark.usefixtures("plugin_autoload")
def test_resnet18_fbgemm_at_least_torch_ao(resnet18):
    ours = _qplug_sqnr(*resnet18, "fbgemm")
    theirs = _torch_ao_sqnr(*resnet18, "fbgemm")
    assert ours >= theirs, (ours, theirs)


def test_resnet18_default_bias_correction_gains_a_decibel_held_out(resnet18):
    """``recipe="auto"`` corrects the mean shift of each conv's int8 weights, measured while
    calibrating; the held-out inputs never seen keep the gain [+1.4 dB here on the reference
    backend; +1.4-1.6 dB with 8 calibration images on 32 held out, bench/bench_bias_correction.py]."""
    model, calibration, held_out, expected = resnet18
    plain = qp.quantize(model, calibration[0], calibration, backend="reference", recipe="none")
    corrected = qp.quantize(model, calibration[0], calibration, backend="reference")
    record = corrected.meta["qplug_recipe"]
    assert record.name == "auto: bias_correction"
    assert len(record.results["bias_correction"]) >= 15  # of ResNet-18's 21 convs and its fc
    with torch.no_grad():
        gain = sqnr(expected, corrected(*held_out)) - sqnr(expected, plain(*held_out))
    assert gain >= 1.0, gain


# -- MobileNetV2 ------------------------------------------------------------------------------------

MOBILENET_FLOOR_DB = 7.0


@pytest.fixture(scope="module")
def mobilenet_v2():
    return _cnn("mobilenet_v2", 112)


def test_mobilenet_v2_reference_sqnr(mobilenet_v2):
    assert _qplug_sqnr(*mobilenet_v2, "reference") >= MOBILENET_FLOOR_DB


@pytest.mark.usefixtures("plugin_autoload")
@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_mobilenet_v2_at_least_torch_ao(mobilenet_v2, backend):
    ours = _qplug_sqnr(*mobilenet_v2, backend)
    theirs = _torch_ao_sqnr(*mobilenet_v2, backend)
    assert ours >= MOBILENET_FLOOR_DB
    assert ours >= theirs, (ours, theirs)


# -- BERT-style encoder -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert():
    model = make_realistic_bert(seed=0)
    calibration = [example_inputs("bert_encoder", batch=8, seed=s) for s in range(1, 4)]
    held_out = [example_inputs("bert_encoder", batch=8, seed=s) for s in (50, 51)]
    assert all(bool((ids_mask[1] == 0).any()) for ids_mask in held_out)  # padding is exercised
    with torch.no_grad():
        expected = torch.cat([model(*batch) for batch in held_out])
    return model, calibration, held_out, expected


def test_bert_encoder_sqnr(bert, backend):
    model, calibration, held_out, expected = bert
    quantized = qp.quantize(model, calibration[0], calibration, backend=backend)
    report = qp.quantization_report(quantized)
    assert {name for name in report.quantized if "dense" in name or "query" in name} != set()
    with torch.no_grad():
        out = torch.cat([quantized(*batch) for batch in held_out])
    assert sqnr(expected, out) >= 40.0
    if backend == "fbgemm":  # every projection runs on the int8 linear kernel
        linears = [n for n in report.quantized if n.endswith(("query", "key", "value", "dense"))]
        assert len(linears) == 12 and all(report.kernels.get(n) == "quantized::linear" for n in linears)


# -- LSTM classifier --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lstm():
    model = get_model("lstm_classifier", seed=0)
    calibration = [example_inputs("lstm_classifier", batch=8, seed=s) for s in range(1, 4)]
    held_out = example_inputs("lstm_classifier", batch=32, seed=50)
    with torch.no_grad():
        expected = model(*held_out)
    return model, calibration, held_out, expected


def test_lstm_static_quantizes_the_linear_head(lstm, backend):
    model, calibration, held_out, expected = lstm
    # the default static mapping leaves RNNs float on purpose, and says so: they are most of the weights
    with pytest.warns(UserWarning, match=r"qplug: 98\.\d% of the model's weights stay float: 'rnn' \(LSTM has "
                                         r"int8 kernels for dynamic quantization only: qp.quantize_dynamic"):
        quantized = qp.quantize(model, calibration[0], calibration, backend=backend)
    report = qp.quantization_report(quantized)
    assert list(report.quantized) == ["fc"]
    assert [(s.node, s.op) for s in report.skipped] == [("rnn", "LSTM")]
    assert "dynamic quantization only" in report.skipped[0].reason
    if backend == "fbgemm":
        assert report.kernels == {"fc": "quantized::linear"}
    with torch.no_grad():
        assert sqnr(expected, quantized(*held_out)) >= 35.0


def test_lstm_dynamic_through_prepare_fx(lstm, backend):
    model, calibration, held_out, expected = lstm
    mapping = qp.get_default_qconfig_mapping(backend, mode="dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dynamic mapping fits the model: no "stays float" warning
        observed = qp.prepare_fx(model, mapping, calibration[0], backend=backend)
        qp.calibrate(observed, calibration)
        quantized = qp.convert_fx(observed)
    report = qp.quantization_report(quantized)
    assert set(report.quantized) == {"rnn", "fc"} and report.skipped == []
    if backend == "fbgemm":
        assert report.kernels == {"rnn": "quantized::lstm_dynamic", "fc": "quantized::linear"}
    with torch.no_grad():
        assert sqnr(expected, quantized(*held_out)) >= 35.0


def test_lstm_dynamic_reference_form_rounds_lstm_weights(lstm):
    model, calibration, _, _ = lstm
    observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping("reference", mode="dynamic"),
                             calibration[0], backend="reference")
    qp.calibrate(observed, calibration)
    quantized = qp.convert_fx(observed)
    rnn = quantized.get_submodule("rnn")
    weight = dict(rnn.named_parameters())
    weight = next(v for k, v in weight.items() if k.endswith("weight_ih_l0"))
    assert not torch.equal(weight, model.rnn.weight_ih_l0)  # rounded onto the int8 grid

"""Defects a new user's first session found (2026-12-06): each test is the user's own call, with the
numbers or the error a user relies on."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.errors import (
    ConfigValidationError,
    InputMismatchError,
    ModelStateError,
    NothingQuantizedError,
    SerializationError,
)
from qplug_core.zoo import get_model

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


class MaskedTokens(nn.Module):
    """Token embeddings times an integer attention mask, as mean-pooling encoders write it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(100, 32), nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.fc2(torch.relu(self.fc1(h))).mean(1)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (2, 12), generator=g), (torch.rand(2, 12, generator=g) > 0.2).long()


def test_a_tensor_times_an_integer_mask_stays_in_reference_form_on_fbgemm():
    """fbgemm's mul kernel takes two int8 tensors or one and a number: the integer mask made
    lowering raise a ConfigValidationError from inside the kernel table, and qp.quantize failed."""
    torch.manual_seed(0)
    model = MaskedTokens().eval()
    with pytest.warns(UserWarning, match="'unsqueeze', is a tensor that is not quantized"):
        qmodel = qp.quantize(model, _tokens(0), [_tokens(i) for i in range(4)], backend="fbgemm")
    report = qp.quantization_report(qmodel)
    assert any("is a tensor that is not quantized" in why for why in report.reference.values()), report.reference
    x = _tokens(9)
    assert _cosine(model(*x), qmodel(*x)) >= 0.999


class ConvBnRelu(nn.Module):
    def __init__(self, relu) -> None:
        super().__init__()
        self.conv, self.bn, self.conv2, self.relu = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3), relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize("relu", [torch.relu, lambda t: t.relu()], ids=["torch.relu", "Tensor.relu"])
def test_conv_bn_then_torch_relu_fuses_like_f_relu(relu):
    """torch.ao's conv patterns have nn.ReLU and F.relu only (torch.relu is a TODO there): conv ->
    bn -> torch.relu left the relu float between two int8 convs, a dequantize/quantize pair."""
    torch.manual_seed(0)
    model = ConvBnRelu(relu).eval()
    data = [torch.randn(4, 3, 12, 12) for _ in range(4)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    report = qp.quantization_report(qmodel)
    assert [f.fused_type for f in report.fusions] == ["ConvReLU2d"] and not report.skipped
    assert qp.sqnr(model(data[0]), qmodel(data[0])) > 25


def test_a_float_lstm_counts_as_compute_left_float():
    """An LSTM returns a tuple, which the report took for integer plumbing: "100% int8" while the
    LSTM held 99.9% of the parameters in float."""
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.fc = nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    data = [torch.randn(2, 5, 16) for _ in range(3)]
    report = qp.quantization_report(qp.quantize(Classifier().eval(), data[0], data, backend="fbgemm"))
    lstm = next(s for s in report.skipped if s.op == "LSTM")
    assert lstm.kind == "compute", lstm


def test_the_cli_compares_layers_with_the_eval_mode_float_model():
    """The zoo's factories return training-mode models; fusing one for the per-layer table raised
    and the table compared int8 ConvReLU kernels with bare float convs: conv1 3.0 dB."""
    from qplug_core.cli._accuracy import accuracy_document

    model = get_model("digits_cnn", seed=0, train=True)
    data = [torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    doc = accuracy_document(model, qmodel, data, backend="fbgemm", evaluated_on="calibration data")
    assert doc["compared_against"] == "fused float model (qp.fuse_fx)" and model.training
    assert min(layer["sqnr_db"] for layer in doc["worst_layers"]) > 25, doc["worst_layers"]


def _converted() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    prepared = qp.prepare_fx(model, None, (torch.randn(1, 3, 8, 8),), backend="fbgemm")
    qp.calibrate(prepared, [torch.randn(4, 3, 8, 8) for _ in range(2)])
    return qp.convert_fx(prepared)


def test_converting_an_int8_model_again_is_refused():
    """The second convert found no observers and returned a model whose report said it was float."""
    with pytest.raises(ModelStateError, match="already converted .* Convert the prepared and calibrated model"):
        qp.convert_fx(_converted())


def test_weight_only_with_nothing_to_quantize_is_refused():
    with pytest.raises(NothingQuantizedError, match="no nn.Linear to quantize"):
        qp.quantize_weights(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()), bits=8)
    with pytest.raises(NothingQuantizedError, match=r"left float: 0: skip= matches its name"):
        qp.quantize_weights(nn.Sequential(nn.Linear(64, 64)), bits=8, skip="0")
    once = qp.quantize_weights(nn.Sequential(nn.Linear(64, 64)), bits=8)
    with pytest.raises(ModelStateError, match=r"already quantized \(layers 0 \(WeightOnlyLinear\)\)"):
        qp.quantize_weights(once, bits=4, group_size=32)


def test_w8a8_refuses_a_quantized_model_and_a_model_with_nothing_to_quantize():
    """quantize_w8a8 of a weight-only (or W8A8) model swapped nothing and said nothing."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    for quantized in (qp.quantize_weights(model, bits=8), qp.quantize_w8a8(model, alpha=None)):
        with pytest.raises(ModelStateError, match=r"already quantized \(layers 0 \("):
            qp.quantize_w8a8(quantized, alpha=None)
    with pytest.raises(NothingQuantizedError, match="no nn.Linear to quantize"):
        qp.quantize_w8a8(nn.Sequential(nn.Conv2d(3, 3, 1)), alpha=None)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_w8a8_on_a_compiling_backend_is_refused_not_simulated(backend):
    """It ran simulated int8 (float math) with no word of it."""
    with pytest.raises(ConfigValidationError, match=f"backend '{backend}' compiles whole graphs"):
        qp.quantize_w8a8(nn.Sequential(nn.Linear(64, 64)).eval(), alpha=None, backend=backend)


def test_weight_only_calibrates_without_dropout_and_returns_eval_mode():
    """A model built from a config starts in train mode: GPTQ fitted its weights to dropped-out
    activations. The result is in eval mode, as qp.quantize, quantize_dynamic and quantize_w8a8
    return theirs (it kept the model's own mode); the user's model keeps its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 32)).train()
    data = [torch.randn(8, 64) for _ in range(2)]
    quantized = qp.quantize_weights(model, bits=4, group_size=32, algorithm="gptq", calibration_data=data)
    assert not quantized.training and not any(m.training for m in quantized.modules()) and model.training
    again = qp.quantize_weights(model.eval(), bits=4, group_size=32, algorithm="gptq", calibration_data=data)
    x = torch.randn(4, 64)
    assert torch.equal(quantized(x), again(x))


@pytest.mark.parametrize("flow", [
    lambda m, x: qp.quantize_weights(m, kernel="reference"),
    lambda m, x: qp.quantize_w8a8(m, alpha=None, backend="reference"),
    lambda m, x: qp.quantize_dynamic(m, backend="reference"),
    lambda m, x: qp.quantize(m, (x,), [(x,)], backend="reference"),
], ids=["quantize_weights", "quantize_w8a8", "quantize_dynamic", "quantize"])
def test_every_flow_returns_its_copy_in_eval_mode(flow):
    """quantize_weights returned a train-mode copy of a train-mode model while its siblings
    returned eval mode: dropout changed silently when switching flows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 32)).train()
    quantized = flow(model, torch.randn(4, 64))
    assert not any(m.training for m in quantized.modules()) and model.training


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dynamic_and_w8a8_refuse_a_half_precision_model_up_front(dtype):
    """Both returned a model whose first call raised torch's dtype mismatch."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(dtype).eval()
    with pytest.raises(ModelStateError, match="is (b)?float16; qplug quantizes float32 models"):
        qp.quantize_dynamic(model, backend="fbgemm")
    with pytest.raises(ModelStateError, match="is (b)?float16; qplug quantizes float32 models"):
        qp.quantize_w8a8(model, alpha=None)


@pytest.mark.parametrize("backend", [3, ["fbgemm"]])
def test_a_backend_that_is_not_a_name_is_refused_by_type(backend):
    data = [torch.randn(2, 4)]
    with pytest.raises(ConfigValidationError, match="backend must be a backend name"):
        qp.quantize(nn.Sequential(nn.Linear(4, 4)), data[0], data, backend=backend)


def test_the_report_of_a_swapped_model_says_what_it_holds():
    """qp.quantization_report said "it was not produced by qp.convert_fx / qp.quantize" for a model
    qp.quantize returned (an LLM keeps generate() through quantize_w8a8); a weight-only or W8A8 model
    now has a report read from its record (tests/regressions/test_llm_reports.py), a dynamic one
    read from its modules: each kernel, and each layer of a type it converts left float, with why."""
    weight_only = qp.quantize_weights(nn.Sequential(nn.Linear(64, 64)), bits=8)
    assert qp.quantization_report(weight_only).quantized == {"0": "linear"}
    w8a8 = qp.quantize_w8a8(nn.Sequential(nn.Linear(64, 64)), alpha=None)
    assert qp.quantization_report(w8a8).quantized == {"0": "per_token_linear"}
    float_model = nn.Sequential(nn.Linear(64, 64), nn.LSTM(64, 8), nn.Linear(8, 8)).eval()
    dynamic = qp.quantize_dynamic(float_model, qconfig_spec={"0", "1"}, backend="fbgemm")
    report = qp.quantization_report(dynamic)
    assert report.kernels == {"0": "DynamicLinear (qint8 weights, fbgemm)",
                              "1": "DynamicLSTM (qint8 weights, fbgemm)"}
    assert [(s.node, s.op) for s in report.skipped] == [("2", "Linear")]
    assert "qconfig_spec names, not this one" in " ".join(str(report).split())


def test_a_batch_the_graph_refuses_is_an_input_mismatch_in_the_passes_too():
    """SmoothQuant's calibration pass let torch's RuntimeError out (an export-captured BERT whose
    batch-1 example fixed the batch size, calibrated at batch 4); calibrate already said which
    batch did not fit."""
    from qplug_core.algorithms._calibration import run_hooked

    graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(InputMismatchError, match="calibration batch 1 does not fit the model: RuntimeError"):
        run_hooked(graph, [(torch.randn(2, 4),), (torch.randn(2, 5),)], [], "smooth_quant")


def test_calibrating_on_constant_inputs_warns():
    """All-zero calibration batches gave scale eps everywhere and an int8 model answering real
    inputs at cosine 0.115, without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    zeros = [torch.zeros(4, 3, 8, 8) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"constant float inputs: input 0 \(every value 0\)"):
        qp.quantize(model, zeros[0], zeros, backend="fbgemm")
    real = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a varying input: no such warning
        qp.calibrate(qp.prepare_fx(model, None, real[0], backend="fbgemm"), [*real, zeros[0]])


def test_a_region_another_backend_prepared_keeps_the_reference_form_where_a_kernel_cannot_be_built():
    """Prepared for onnxruntime (whose linear output stays float), converted for fbgemm: the
    linear kernel's missing output qparams raised out of convert_fx."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    data = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    prepared = qp.prepare_fx(model, None, data[0], backend="onnxruntime")
    qp.calibrate(prepared, data)
    with pytest.warns(UserWarning, match="node '3': kernel quantized::linear writes an int8 output, and this "
                                         "region's output is float: the model was quantized for a backend"):
        qmodel = qp.convert_fx(prepared, backend="fbgemm")
    assert list(qp.quantization_report(qmodel).reference) == ["3"]
    assert qp.sqnr(model(data[0]), qmodel(data[0])) > 30


@pytest.mark.slow
def test_a_generating_model_asked_for_a_graph_is_captured_without_its_kv_cache():
    """capture="export" (or a compiling backend) on a LlamaForCausalLM raised torch.export's "Found
    DynamicCache in output"; the docs promise the graph, with a warning that it cannot generate."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    data = [torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.warns(UserWarning, match="captures LlamaForCausalLM as a graph, which has no generate"):
        qmodel = qp.quantize(model, (data[0],), data, backend="fbgemm", capture="export")
    assert isinstance(qmodel, torch.fx.GraphModule) and model.config.use_cache is True
    with torch.no_grad():
        assert _cosine(model(data[2]).logits, qmodel(data[2]).logits) > 0.99


class BranchesOnBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.shape[0] > 1:  # torch.export keeps the example's branch and guards its batch size
            h = h * 2
        return self.b(h)


def test_a_loaded_export_graph_refuses_the_sizes_its_capture_did_not_cover(tmp_path):
    """Export's guard is not saved: after qp.load a batch-1 capture answered batch 3 with the batch-1
    branch, cosine 0.92 against float, without a word."""
    torch.manual_seed(0)
    model = BranchesOnBatch().eval()
    one = [torch.randn(1, 16) for _ in range(8)]
    qmodel = qp.quantize(model, one[0], one, backend="fbgemm")
    assert qp.quantization_report(qmodel).capture == "export"
    loaded = qp.load(qp.save(qmodel, tmp_path / "one.safetensors"))
    torch.testing.assert_close(loaded(one[0]), qmodel(one[0]), rtol=0, atol=0)
    with pytest.raises(InputMismatchError, match=r"input 'x' has size 3 at dim 0 \(captured with 1\)"):
        loaded(torch.randn(3, 16))
    four = [torch.randn(4, 16) for _ in range(8)]  # a dynamic batch: other batch sizes are fine
    loaded = qp.load(qp.save(qp.quantize(model, four[0], four, backend="fbgemm"), tmp_path / "four.safetensors"))
    x = torch.randn(3, 16)
    assert qp.sqnr(model(x), loaded(x)) > 25


def test_eager_convert_refuses_a_model_without_a_quant_stub():
    """prepare / calibrate / convert accepted it, and the first call raised torch's "Could not run
    'quantized::conv2d.new' with arguments from the 'CPU' backend"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    observed = qp.eager.prepare(model, backend="fbgemm")
    with torch.no_grad():
        observed(torch.randn(4, 3, 8, 8))
    with pytest.raises(ModelStateError, match=r"has no QuantStub: its int8 modules \(0, 2\)"):
        qp.eager.convert(observed)
    wrapped = qp.eager.prepare(qp.eager.QuantWrapper(model), backend="fbgemm")
    data = [torch.randn(4, 3, 8, 8) for _ in range(8)]
    with torch.no_grad():
        for x in data:
            wrapped(x)
    assert qp.sqnr(model(data[0]), qp.eager.convert(wrapped)(data[0])) > 25


def test_compare_names_the_model_a_batch_does_not_fit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    with pytest.raises(InputMismatchError, match="the float model raised on batch 0: RuntimeError"):
        qp.compare(model, qmodel, [torch.randn(2, 3, 9, 9)])
    with pytest.raises(InputMismatchError, match="the quantized model raised on batch 0"):
        qp.compare(model, nn.Sequential(nn.Linear(3, 3)), data)


def test_an_unknown_keyword_to_quantize_names_itself_and_its_likely_spelling():
    """It raised prepare_fx()'s TypeError, a function the user never called."""
    data = [torch.randn(2, 4)]
    with pytest.raises(ConfigValidationError, match=r"unknown keyword argument 'bakend' \(did you mean 'backend'\?\)"):
        qp.quantize(nn.Sequential(nn.Linear(4, 4)).eval(), data[0], data, bakend="fbgemm")


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_a_compiled_partition_answers_an_empty_batch(backend):
    """OpenVINO refused to compile a batch of size 0 (OpConversionFailure); fbgemm returns (0, 5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).eval()
    data = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend=backend)
    assert qmodel(torch.randn(0, 3, 8, 8)).shape == (0, 5)
    assert qp.sqnr(model(data[0]), qmodel(data[0])) > 25


class OptionalScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if scale is not None:
            h = h * scale
        return self.b(h)


def test_a_parameter_the_example_leaves_out_is_traced_as_its_default():
    """Traced as an input, ``scale`` was a Proxy, ``scale is not None`` took the branch the model
    never takes when called like its example, and the error blamed the example inputs."""
    torch.manual_seed(0)
    model = OptionalScale().eval()
    data = [torch.randn(4, 16) for _ in range(4)]
    qmodel = qp.quantize(model, (data[0],), data, backend="fbgemm")
    assert qp.quantization_report(qmodel).capture == "symbolic"
    assert qp.sqnr(model(data[0]), qmodel(data[0])) > 30
    with pytest.raises(InputMismatchError, match=r"called with 2 positional inputs; it takes the inputs \(x\) "
                                                 r"it was quantized with.*an argument left out of example_inputs"):
        qmodel(data[0], torch.ones(16))  # the graph holds the default's branch only: not silently


def test_an_auto_file_ranks_only_the_backends_measured_on_the_form_it_holds():
    """A file holds the winner's reference form; the fallback ranking also held backends finished
    from another base (an accuracy target or a transformer calibrates one base per set of
    float-output kinds: qnnpack beside onnxruntime's float-output linears), so qp.load fell back
    to one that left every linear in reference form. Machine-independent: whoever wins, the
    ranking shares its output convention."""
    from qplug_core.flows.tags import AUTO_RANKING
    from qplug_core.registry.backends import get_backend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend="auto", target=qp.Target(cosine=0.0))
    report = qp.quantization_report(qmodel)
    ranking = qmodel.meta[AUTO_RANKING]
    assert ranking[0] == report.backend
    assert {get_backend(name).float_outputs for name in ranking} == {get_backend(report.backend).float_outputs}
    timed = {t["backend"] for t in report.auto if t["median_ms"] is not None}
    assert set(ranking) <= timed


def test_a_per_token_t5_encoder_runs():
    """T5's feed-forward reads ``self.wo.weight.dtype`` on every call: the per-token layer had no
    ``weight`` and the first forward raised AttributeError (per-tensor dynamic had one)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    model = transformers.T5EncoderModel(config).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    qmodel = qp.quantize_dynamic(model, backend="fbgemm", per_token=True)
    layer = qmodel.encoder.block[0].layer[1].DenseReluDense.wo
    assert layer.weight.dtype == torch.float32 and layer.weight.shape == (64, 128)
    with torch.no_grad():
        assert _cosine(model(input_ids=ids).last_hidden_state, qmodel(input_ids=ids).last_hidden_state) > 0.999


@pytest.mark.parametrize("plugin", ["qplug_onnxruntime", "qplug_openvino"])
def test_a_misspelled_setting_names_itself_and_the_settings(plugin):
    """configure(num_thread=2) raised the settings dataclass's TypeError."""
    configure = __import__(plugin).configure
    with pytest.raises(ConfigValidationError, match=rf"{plugin}.configure\(\) has no setting 'num_thread' "
                                                    r"\(did you mean 'num_threads'\?\)"):
        configure(num_thread=2)


def test_a_missed_target_shows_the_digits_that_differ():
    """Target(cosine=0.99999) missed by 0.99998 read "cosine 1 < 1"."""
    from qplug_core.algorithms.sensitivity import OutputScore

    score = OutputScore(cosine_mean=0.999981, cosine_min=0.99, sqnr_db=40.0)
    assert qp.Target(cosine=0.99999).misses(score) == ["cosine 0.99998 < 0.99999"]
    assert qp.Target(sqnr=45).misses(score) == ["sqnr 40 < 45"]


def test_a_reflect_padded_conv_left_in_reference_form_is_reported_as_the_users_layer():
    """fbgemm's conv kernels pad with zeros only: the conv stays in reference form, and the report
    listed it as ``ReferenceWeighted`` (qplug's wrapper) instead of the ConvReLU2d the user fused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1)).eval()
    data = [(torch.randn(1, 3, 16, 16),) for _ in range(4)]
    with pytest.warns(UserWarning, match="padding_mode='reflect' is not supported"):
        qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    report = qp.quantization_report(qmodel)
    assert [entry.op for entry in report.skipped] == ["ConvReLU2d"]
    assert "ReferenceWeighted" not in str(report)
    x = torch.randn(1, 3, 16, 16)
    assert _cosine(model(x), qmodel(x)) >= 0.999


def test_a_model_exported_from_a_batch_1_example_takes_other_batch_sizes():
    """torch.export specialises a size-1 dimension: captured from one sentence, a model refused
    calibration batches of 4 and then every batch but 1, with a raw RuntimeError."""
    torch.manual_seed(0)
    model = MaskedTokens().eval()
    batches = [_tokens(i) for i in range(4)]  # batch 2 each
    one = tuple(t[:1] for t in batches[0])
    qmodel = qp.quantize(model, one, batches, backend="reference", capture="export")
    x = tuple(torch.cat(parts) for parts in zip(*batches[:2]))  # batch 4
    assert qmodel(*x).shape == (4, 8)
    assert _cosine(model(*x), qmodel(*x)) >= 0.99


def test_a_file_that_does_not_fit_leaves_the_users_model_unchanged(tmp_path):
    """qp.load(path, model=m) raised that the file did not fit after copying into m every float
    tensor that did: the user's model was half overwritten."""
    torch.manual_seed(0)
    saved = qp.save(qp.quantize_weights(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8), nn.LayerNorm(8)),
                                        bits=8, skip="2"), tmp_path / "small.safetensors")
    other = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))
    before = {key: value.clone() for key, value in other.state_dict().items()}
    with pytest.raises(SerializationError, match=r"does not fit .*other shapes .*2.weight \(8, 64\) \(the model's "
                                                 r"\(16, 64\)\).*it was left unchanged"):
        qp.load(saved, model=other)
    assert all(torch.equal(before[key], value) for key, value in other.state_dict().items())
    assert type(other[0]) is nn.Linear


def test_a_w8a8_file_refuses_a_bfloat16_model_at_load(tmp_path):
    """It loaded, and the first call raised torch's "expected m1 and m2 to have the same dtype"."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    path = qp.save(qp.quantize_w8a8(model, alpha=None), tmp_path / "w8a8.safetensors")
    with pytest.raises(ModelStateError, match="is bfloat16; qplug quantizes float32 models: load into model.float"):
        qp.load(path, model=nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch.bfloat16))


def test_a_misspelled_backend_at_load_is_the_callers_not_the_files(tmp_path):
    """qp.load(p, backend="fbgem") said the file was converted for 'fbgem' and to pip install
    qplug-fbgem, a package that does not exist."""
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    path = qp.save(qp.quantize(model, data[0], data, backend="fbgemm"), tmp_path / "m.safetensors")
    with pytest.raises(qp.errors.BackendNotFoundError, match=r"qp.load\(..., backend='fbgem'\): no backend of that "
                                                             r"name is installed \(did you mean 'fbgemm'\?\).*leave "
                                                             r"backend out for the one m.safetensors was converted "
                                                             r"for \('fbgemm'\)"):
        qp.load(path, backend="fbgem")


def test_a_skip_pattern_that_matches_nothing_warns_and_a_bad_one_is_refused():
    """skip=["fc"] (not the whole name) quantized every layer without a word; skip="[" raised re.error."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32))).eval()
    with pytest.warns(UserWarning, match=r"skip= pattern\(s\) \['fc'\] match no layer: a pattern matches a whole "
                                         r"module name \(e.g. '2.0'; '.\*0' matches"):
        qp.quantize_weights(model, bits=8, skip=["fc", "2.0"])
    with pytest.raises(ConfigValidationError, match="skip= must be regular expressions"):
        qp.quantize_weights(model, bits=8, skip="[")
    with pytest.raises(ConfigValidationError, match="skip= must be regular expressions"):
        qp.quantize_w8a8(model, alpha=None, skip="[")


def _nan_in_first_weight() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    return model


@pytest.mark.parametrize("flow", ["weights", "w8a8", "dynamic", "static"])
def test_a_nan_weight_is_named_up_front_and_the_model_left_alone(flow):
    """A NaN weight ended weight-only in "no weight-only kernel runs ...: relative error nan" and the
    static flow in an observer's error: neither named the layer."""
    model = _nan_in_first_weight()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = {"weights": lambda: qp.quantize_weights(model, bits=8),
             "w8a8": lambda: qp.quantize_w8a8(model, alpha=None),
             "dynamic": lambda: qp.quantize_dynamic(model, backend="fbgemm"),
             "static": lambda: qp.quantize(model, (torch.randn(4, 64),), [(torch.randn(4, 64),)],
                                           backend="fbgemm")}
    with pytest.raises(ModelStateError, match=r"non-finite values \(NaN or Inf\) in '0.weight' \(1 of 2048\)"):
        calls[flow]()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "0.weight")
    assert torch.equal(before["0.weight"].nan_to_num(), after["0.weight"].nan_to_num())


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("call", ["gptq", "awq", "w8a8"])
def test_calibration_a_language_model_cannot_take_says_which_batch_and_why(call):
    """Float batches or token ids past the vocabulary raised the embedding's own RuntimeError /
    IndexError from deep inside the model, where qp.quantize says InputMismatchError."""
    model = _llama()

    def run(batches):
        if call == "w8a8":
            return qp.quantize_w8a8(model, batches)
        return qp.quantize_weights(model, bits=4, group_size=32, algorithm=call, calibration_data=batches)

    good = torch.randint(0, 256, (2, 16))
    with pytest.raises(InputMismatchError, match=r"calibration batch 1 does not fit the model: RuntimeError: .*"
                                                 r"\(the batch is float32; the model takes token ids, torch.long\)"):
        run([good, torch.randn(2, 16)])
    with pytest.raises(InputMismatchError, match=r"calibration batch 0 does not fit the model: IndexError: .*"
                                                 r"token ids from \d+ to \d+; the vocabulary has 256\)"):
        run([torch.randint(200, 300, (2, 16))])


def test_compare_of_a_w8a8_model_leaves_out_the_layers_smoothquant_rescaled():
    """qp.compare(llm, w8a8) ranked the RMSNorms first at 1-3 dB (and up_proj at 6 dB): SmoothQuant
    folds scales into them by design and the next layer undoes it, so those rows said nothing."""
    model = _llama()
    qmodel = qp.quantize_w8a8(model, [torch.randint(0, 256, (2, 16))])
    rescaled = {entry.into for entry in qmodel.qplug_w8a8.smoothed}
    assert any(name.endswith("layernorm") for name in rescaled), rescaled
    report = qp.compare(model, qmodel, [torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))])
    assert not rescaled & {layer.name for layer in report.layers}
    assert all("SmoothQuant folded a scale into it" in report.skipped[name] for name in rescaled)
    assert min(layer.sqnr_db for layer in report.layers if layer.quant_type == "PerTokenDynamicLinear") > 20


def test_the_backend_picked_for_the_user_is_announced_once(capsys):
    """qp.quantize with no backend printed "qplug: using backend 'fbgemm'" twice (the default bias
    correction resolved the backend a second time)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    qp.quantize(model, (torch.randn(2, 8),), [(torch.randn(2, 8),)])
    assert capsys.readouterr().err.count("using backend") == 1


def test_converting_an_exported_graph_gives_no_torch_deprecation_warning():
    """Every convert of an export-captured model showed torch's own "isinstance(treespec, LeafSpec)
    is deprecated" FutureWarning (from copying the graph's pytree specs), pointing at copyreg.py."""
    model = _llama()  # transformers' pytree registrations put LeafSpecs in the graph's specs
    tokens = torch.randint(0, 256, (1, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qp.quantize(model, (tokens,), [(tokens,)], backend="fbgemm", capture="export")
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def _conv_bn_relu_fc() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def test_qat_with_the_static_mapping_is_refused_and_a_partly_float_qat_mapping_trains_in_int8():
    """The static mapping's qconfigs only observe: prepare_qat_fx (torch.ao's too) gave a model whose
    forward was the float model's, so "QAT" trained in float without a word."""
    x = torch.randn(4, 1, 8, 8)
    static = qp.get_default_qconfig_mapping("fbgemm")
    with pytest.raises(ConfigValidationError, match=r"prepare_qat_fx: the qconfigs have no FakeQuantize .*"
                                                    r"qp.get_default_qconfig_mapping\(backend, mode=\"qat\"\)"):
        qp.prepare_qat_fx(_conv_bn_relu_fc().train(), static, (x,), backend="fbgemm")
    with pytest.raises(ConfigValidationError, match=r"prepare_qat: the qconfigs have no FakeQuantize"):
        qp.eager.prepare_qat(nn.Sequential(qp.eager.QuantStub(), _conv_bn_relu_fc(), qp.eager.DeQuantStub()),
                             static, backend="fbgemm")
    model = _conv_bn_relu_fc().train()
    mapping = qp.get_default_qconfig_mapping("fbgemm", mode="qat").set_module_name("4", None)
    prepared = qp.prepare_qat_fx(model, mapping, (x,), backend="fbgemm")
    assert type(prepared.get_submodule("0").weight_fake_quant).__name__ == "FakeQuantize"
    assert (prepared(x) - model(x)).abs().max() > 1e-3  # fake quant in the forward pass
    assert isinstance(qp.prepare_qat_fx(model, qp.QConfigMapping(), (x,), backend="fbgemm"), torch.fx.GraphModule)


@pytest.mark.parametrize("call", ["gptq", "awq", "w8a8"])
def test_one_batch_tensor_as_calibration_is_one_batch(call):
    """``calibration or ()`` raised torch's "Boolean value of Tensor ... is ambiguous" on a tensor;
    qp.calibrate and qp.quantize take a bare tensor as one batch, and so do these now."""
    model = _llama()

    def run(calibration):
        if call == "w8a8":
            return qp.quantize_w8a8(model, calibration)
        return qp.quantize_weights(model, bits=4, group_size=32, algorithm=call, calibration_data=calibration,
                                   kernel="reference")  # the same kernel for both, whatever timing says

    batch, x = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        expected = run([batch])(x).logits
        assert torch.equal(run(batch)(x).logits, expected)
        # a tokenizer's output (a dict of model inputs) is one batch too: iterating gave its keys
        assert torch.equal(run({"input_ids": batch})(x).logits, expected)


@pytest.mark.parametrize("flow", ["prepare_fx", "prepare_qat_fx"])
def test_prepare_without_example_inputs_says_they_are_required(flow):
    """example_inputs defaults to None, and prepare ran the model on None: an InputMismatchError with
    torch's conv2d overload listing for "(NoneType)" inputs."""
    model = _conv_bn_relu_fc().train(flow == "prepare_qat_fx")
    mapping = qp.get_default_qconfig_mapping("fbgemm", mode="qat" if flow == "prepare_qat_fx" else "static")
    with pytest.raises(ConfigValidationError, match=r"^example_inputs is required: .* pass a tuple of positional"):
        getattr(qp, flow)(model, mapping, backend="fbgemm")


def test_compare_against_the_fused_float_model_finds_no_module_absent():
    """As the quickstart does: compare() against qp.fuse_fx(model) counted the fused ConvReLU2d's
    children as absent and advised comparing against the fused float model, already done."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 10)).eval()
    data = [torch.randn(8, 3, 32, 32) for _ in range(2)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    report = qp.compare(qp.fuse_fx(model, backend="fbgemm"), qmodel, data)
    assert report.float_only == [] and "absent" not in str(report)
    assert [(layer.name, layer.float_type) for layer in report.layers][0] == ("0", "ConvReLU2d")
    assert qp.compare(model, qmodel, data).float_only == ["1", "2"]  # the unfused model: bn, relu fused away


def test_saving_an_eager_model_says_eager_models_are_not_saved_and_what_to_do(tmp_path):
    """qp.save said the eager int8 model "was not produced by qp.convert_fx ...; quantize it with
    qplug first": it was, in eager mode, which qp.save does not write."""
    torch.manual_seed(0)
    model = nn.Sequential(qp.eager.QuantStub(), nn.Conv2d(3, 8, 3), nn.ReLU(), qp.eager.DeQuantStub()).eval()
    observed = qp.eager.prepare(qp.eager.fuse_modules(model, [["1", "2"]]), backend="fbgemm")
    observed(torch.randn(4, 3, 8, 8))
    for eager in (observed, qp.eager.convert(observed)):
        with pytest.raises(SerializationError, match=r"comes from qplug's eager mode .* which qp.save does not "
                                                     r"write.* quantize with graph mode \(qp.quantize") as raised:
            qp.save(eager, tmp_path / "eager.safetensors")
        assert "quantize it with qplug first" not in str(raised.value)
    assert not (tmp_path / "eager.safetensors").exists()


def test_auto_with_a_target_calibrates_every_base_from_a_generator():
    """backend='auto' with a target calibrates one base per set of float-output kinds: the second
    found the generator spent and said "0 batches observed (0 given, all empty)" of 8 batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)).eval()
    data = [torch.randn(4, 3, 16, 16) for _ in range(8)]
    qmodel = qp.quantize(model, data[0], (batch for batch in data), backend="auto", target=qp.Target(sqnr=30))
    assert qp.quantization_report(qmodel).auto and qp.sqnr(model(data[0]), qmodel(data[0])) > 30


@pytest.mark.parametrize("call", [
    lambda model, data: qp.sensitivity(model, data[0], data, backend="auto"),
    lambda model, data: qp.prepare_fx(model, None, data[0], backend="auto"),
    lambda model, data: qp.quantize_dynamic(model, backend="auto"),
    lambda model, data: qp.quantize_weights(model, backend="auto"),
    lambda model, data: qp.get_default_qconfig_mapping(backend="auto"),
], ids=["sensitivity", "prepare_fx", "quantize_dynamic", "quantize_weights", "qconfig_mapping"])
def test_auto_outside_quantize_asks_for_one_backend_not_a_plugin(call):
    """qp.sensitivity(backend='auto'), the value qp.quantize takes, said no backend 'auto' was
    installed and to install the plugin distribution providing it."""
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    data = [torch.randn(4, 16) for _ in range(2)]
    with pytest.raises(ConfigValidationError, match=r"backend='auto' quantizes on every installed backend "
                       r"and keeps the fastest, which only qp.quantize does; this works on one backend: "
                       r"name one \(installed: .*fbgemm") as raised:
        call(model, data)
    assert "install the plugin" not in str(raised.value)


def test_a_metric_that_cannot_take_both_output_lists_is_refused_naming_the_signature():
    """Target(metric=lambda outputs: ...) raised "TypeError: <lambda>() takes 1 positional argument
    but 2 were given" from inside the search; the guide never gave the signature."""
    signature = r"metric\(reference_outputs, quantized_outputs\) -> float, each a list with one tensor per"
    with pytest.raises(ConfigValidationError, match=rf"Target.metric: <lambda>\(outputs\) cannot take two "
                                                    rf"positional arguments; it is called as {signature}"):
        qp.Target(metric=lambda outputs: 1.0, minimum=0.5)
    torch.manual_seed(0)  # the target below asks every row's argmax to agree: not on any random data
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    data = [torch.randn(4, 16) for _ in range(2)]
    with pytest.raises(ConfigValidationError, match=rf"qp.sensitivity\(metric=...\): .* {signature}"):
        qp.sensitivity(model, data[0], data, backend="fbgemm", metric=lambda outputs: 1.0)

    def agreement(reference: list, quantized: list, *, digits: int = 3) -> float:
        return float(sum(bool((r.argmax(1) == q.argmax(1)).all()) for r, q in zip(reference, quantized)))

    for metric in (agreement, lambda *outputs: 1.0):  # two positional arguments are all it needs
        assert qp.Target(metric=metric, minimum=0.0).metric is metric
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", target=qp.Target(metric=agreement, minimum=1.0))
    assert qmodel.meta["qplug_target"].final.metric == len(data)


def test_copying_an_exported_graph_shows_no_torch_pytree_warning(tmp_path):
    """qp.compare(qp.fuse_fx(model), qmodel) on an onnxruntime model of an exported graph (HF ViT)
    printed torch's "FutureWarning: isinstance(treespec, LeafSpec) is deprecated" from copyreg:
    qplug's deep copies of the graph, nothing the user can change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    qmodel = qp.quantize(model, data[0], data, backend="onnxruntime", capture="export")
    observed = qp.calibrate(qp.prepare_fx(model, None, data[0], backend="fbgemm", capture="export"), data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        report = qp.compare(qp.fuse_fx(model, data[0], backend="onnxruntime", capture="export"), qmodel, data)
        qp.convert_fx(observed, backend="fbgemm")  # a copy: the observed model stays as it was
        qp.export_onnx(qmodel, tmp_path / "model.onnx")
    assert [layer.name for layer in report.layers] == ["delegate_0"] and report.output_sqnr_db > 30


class ScaledTokens(nn.Module):
    """Token ids (integer) beside float features: only the float input must be float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(input_ids) + features)


@pytest.mark.parametrize("backend", ["reference", "fbgemm", "onnxruntime", "openvino"])
def test_an_input_that_is_not_float32_is_one_qplug_error_on_every_backend(backend, tmp_path):
    """float16/bfloat16/float64 inputs gave each runtime's own error (fbgemm "Quantize only works on
    Float Tensor", ONNX Runtime "INVALID_GRAPH: This is an invalid model"), and openvino ran float16."""
    torch.manual_seed(0)
    model = ScaledTokens().eval()
    data = [(torch.randint(0, 50, (2, 6)), torch.randn(2, 6, 16)) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend=backend)
    ids, features = data[0]
    loaded = qp.load(qp.save(qmodel, tmp_path / "model.safetensors"))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for call in (lambda m: m(ids, features.to(dtype)), lambda m: m(ids, features=features.to(dtype))):
            for int8 in (qmodel, loaded):
                with pytest.raises(InputMismatchError, match=rf"input 'features' is {str(dtype)[6:]}; the int8 "
                                   r"model takes float32 inputs .*: pass features.float\(\)"):
                    call(int8)
    with torch.no_grad():
        assert torch.equal(qmodel(ids.int(), features), qmodel(ids, features))  # integer inputs: any dtype
        assert _cosine(model(ids, features), qmodel(ids, features=features)) > 0.99


def test_an_all_ones_attention_mask_is_no_constant_input_the_int8_model_keeps():
    """The accuracy guide's step 3 (an all-ones float attention_mask) warned that "the int8 model
    keeps only that value there", but the mask reaches no observer but the softmax's, which saw a
    range: the int8 model applies a padding mask passed later (44 dB against float, 8 dB unmasked)."""
    from qplug_core.zoo.transformer import make_realistic_bert

    bert = make_realistic_bert(seed=0, layers=1, hidden=64, heads=4, intermediate=128)
    g = torch.Generator().manual_seed(1)
    tokens = [(torch.randint(0, 1000, (2, 16), generator=g), torch.ones(2, 16)) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guide = qp.quantize(bert, tokens[0], tokens, backend="reference",
                            target=qp.Target(cosine=0.9999, group="role"))
        qmodel = qp.quantize(bert, tokens[0], tokens, backend="fbgemm", recipe="none")
    assert not [w for w in caught if "constant float inputs" in str(w.message)]
    ids, mask = torch.randint(0, 1000, (2, 16), generator=g), torch.ones(2, 16)
    mask[1, 3:] = 0
    with torch.no_grad():
        want = bert(ids, mask)[1]  # the padded row's pooled embedding
        assert qp.sqnr(want, bert(ids, torch.ones(2, 16))[1]) < 12  # the mask matters
        for int8 in (guide, qmodel):
            assert qp.sqnr(want, int8(ids, mask)[1]) > 35


def test_a_torch_ao_config_object_is_named_as_torch_aos():
    """Porting from torch.ao, a user passing its QConfigMapping read "qconfig_mapping must be a
    QConfigMapping, got QConfigMapping" (the classes share names)."""
    import torch.ao.quantization as tq

    model = nn.Sequential(nn.Linear(4, 4)).eval()
    with pytest.raises(ConfigValidationError, match=r"must be a QConfigMapping, got torch.ao's "
                                                    r"torch.ao.quantization.qconfig_mapping.QConfigMapping: qplug "
                                                    r"takes its own \(qp.QConfigMapping"):
        qp.prepare_fx(model, tq.get_default_qconfig_mapping("fbgemm"), (torch.randn(2, 4),), backend="fbgemm")
    with pytest.raises(ConfigValidationError, match=r"global_qconfig must be qplug's QConfig or None, got "
                                                    r"torch.ao's torch.ao.quantization.qconfig.QConfig"):
        qp.QConfigMapping().set_global(tq.get_default_qconfig("fbgemm"))


def test_exporting_a_module_swap_model_names_the_graph_route():
    """export_onnx on a qp.quantize_dynamic model sent the user to the static qp.quantize."""
    from qplug_core.errors import ExportError

    model = nn.Sequential(nn.Linear(8, 8)).eval()
    with pytest.raises(ExportError, match=r"for dynamic int8, qp.convert_fx\(qp.prepare_fx\(model, "
                                          r"qp.get_default_qconfig_mapping\(backend, mode='dynamic'\)"):
        qp.export_onnx(qp.quantize_dynamic(model, backend="fbgemm"), "unused.onnx")


def test_a_transformer_quantized_from_its_exported_program_gets_the_modules_recipe():
    """An ExportedProgram's modules are flattened, so recipe="auto" saw no LayerNorm and gave the
    program no SmoothQuant (and bias correction instead): the export guide's BERT quantized from its
    program was another int8 model than from the module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32)).eval()
    x = torch.randn(8, 32)
    batches = [(torch.randn(8, 32),) for _ in range(4)]
    from_module = qp.quantize(model, (x,), batches, backend="fbgemm")
    from_program = qp.quantize(torch.export.export(model, (x,)), (x,), batches, backend="fbgemm")
    recipes = [m.meta["qplug_recipe"].name for m in (from_module, from_program)]
    assert recipes == ["auto: smoothquant", "auto: smoothquant"]
    assert torch.equal(from_module(x), from_program(x))


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_norm_the_defaults_keep_float_says_why_not_not_requested(backend):
    """With the backend's default mapping a LayerNorm stays float on purpose, but the report said
    "qconfig is None for this op (not requested)": the user had requested nothing. It names the
    default's reason and how to quantize it; a layer the user set to None keeps the plain reason."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 8)).eval()
    batches = [(torch.randn(4, 16),) for _ in range(4)]
    mapping = qp.get_default_qconfig_mapping(backend=backend).set_module_name("2", None)
    report = qp.quantization_report(qp.quantize(model, batches[0], batches, backend=backend,
                                                qconfig_mapping=mapping))
    reasons = {s.node: s.reason for s in report.skipped}
    assert reasons["1"].startswith("qconfig is None for this op type: qplug's default mapping keeps "
                                   "normalization and softmax float in static mode")
    assert reasons["1"].endswith("set a qconfig for it to quantize it")
    assert reasons["2"] == "qconfig is None for this op (not requested)"

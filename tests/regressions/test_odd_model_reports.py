"""Defects a user with models and inputs off the textbook path found (2026-12-06): each test is
that user's own call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DictInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.a(inputs["p"]) + self.b(inputs["q"])


class ListInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.a(inputs[0] + inputs[1])


@pytest.mark.parametrize("capture", ["symbolic", "export"])
@pytest.mark.parametrize("model, batch", [
    (DictInputs, lambda: {"p": torch.randn(4, 16), "q": torch.randn(4, 16)}),
    (ListInputs, lambda: [torch.randn(4, 16), torch.randn(4, 16)]),
], ids=["dict", "list"])
def test_a_model_taking_a_dict_or_list_of_tensors_calibrates(model, batch, capture):
    """calibrate counted only top-level tensors, so every such batch was "empty": CalibrationError
    "0 batches observed (8 given, all empty)" although the observers had run on all of them."""
    torch.manual_seed(0)
    float_model = model().eval()
    example = (batch(),)
    int8 = qp.quantize(float_model, example, [(batch(),) for _ in range(8)], backend="fbgemm", capture=capture)
    with torch.no_grad():
        assert qp.sqnr(float_model(*example), int8(*example)) > 20  # 25-32 dB measured
    assert set(qp.quantization_report(int8).kernels.values()) == {"quantized::linear"}


class DictAndIds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Embedding(10, 16)

    def forward(self, inputs: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        return self.a(inputs["p"] + inputs["q"]) + self.b(ids)


def test_a_dict_argument_before_a_token_argument_is_not_taken_for_its_dtype():
    """The dtype check counted placeholders as argument positions: export's graph has one per tensor
    inside the dict, so it read ``ids`` (int64) as the dict's second float tensor and refused every
    calibration batch ("input 'inputs_q' is int64 where ... captured with float32")."""
    torch.manual_seed(0)
    model = DictAndIds().eval()

    def batch():
        return {"p": torch.randn(4, 16), "q": torch.randn(4, 16)}, torch.randint(0, 10, (4,))

    int8 = qp.quantize(model, batch(), [batch() for _ in range(8)], backend="fbgemm", capture="export")
    inputs, ids = batch()
    with torch.no_grad():
        assert qp.sqnr(model(inputs, ids), int8(inputs, ids)) > 25  # 37 dB measured
    with pytest.raises(InputMismatchError, match=r"input 'ids' is float32 where .* captured with int64"):
        int8(inputs, ids.float())


@pytest.mark.parametrize("change, error", [
    (lambda inputs: {**inputs, "p": inputs["p"].double()}, r"input \"inputs\['p'\]\" is float64; the int8 model "
                                                           r"takes float32 inputs .* pass inputs\['p'\]\.float\(\)"),
    (lambda inputs: {**inputs, "q": None}, r"input \"inputs\['q'\]\" is None"),
    (lambda inputs: {"p": inputs["p"]}, r"input 'inputs' is a dict with keys \['p'\], without 'q': the model was "
                                        r"captured \(torch.export\) with inputs\['q'\] in it"),
    (lambda inputs: {**inputs, "q": inputs["q"][:, :8]}, r"input \"inputs\['q'\]\" has size 8 at dim 1 \(captured "
                                                         r"with 16\)"),
], ids=["float64", "None", "missing-key", "wrong-size"])
def test_a_tensor_inside_a_dict_argument_is_checked_like_a_whole_argument(change, error):
    """Only whole arguments were checked: each of these met torch's own error inside the graph
    ("Quantize only works on Float Tensor", a TypeError adding None, KeyError 'q', a size mismatch
    printed with generated code)."""
    torch.manual_seed(0)
    model = DictAndIds().eval()

    def batch():
        return {"p": torch.randn(4, 16), "q": torch.randn(4, 16)}, torch.randint(0, 10, (4,))

    int8 = qp.quantize(model, batch(), [batch() for _ in range(4)], backend="fbgemm", capture="export")
    inputs, ids = batch()
    with pytest.raises(InputMismatchError, match=error):
        int8(change(inputs), ids)


class NoGradBlock(nn.Module):
    """Speech2Text computes its sinusoidal positions under ``torch.no_grad()`` the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.a(x)
        return self.b(torch.relu(hidden))


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_linear_inside_a_no_grad_block_quantizes_with_export_capture(backend, tmp_path):
    """torch.export wrapped the block in a ``wrap_with_set_grad_enabled`` submodule: its linear
    stayed float ("no quantization pattern ... matches"), qp.save refused the model, and ONNX
    Runtime compiled no partition at all. Exported with gradients off, the block is inline."""
    torch.manual_seed(0)
    model, x = NoGradBlock().eval(), torch.randn(4, 16)
    int8 = qp.quantize(model, (x,), [(torch.randn(4, 16),) for _ in range(8)], backend=backend, capture="export")
    report = qp.quantization_report(int8)
    assert report.skipped == [] and report.reference == {}, report
    assert sorted(report.quantized) == ["a", "b"], report
    loaded = qp.load(qp.save(int8, tmp_path / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(x), int8(x)) and qp.sqnr(model(x), int8(x)) > 25


def test_qat_export_capture_keeps_a_no_grad_block_out_of_training():
    """QAT exports the training-mode model as before: no gradient reaches the blocked linear."""
    torch.manual_seed(0)
    prepared = qp.prepare_qat_fx(NoGradBlock().train(), None, (torch.randn(4, 16),), backend="fbgemm",
                                 capture="export")
    prepared(torch.randn(4, 16)).sum().backward()
    grads = {name: p.grad for name, p in prepared.named_parameters() if name.endswith("weight")}
    assert grads["b.weight"] is not None and grads["a.weight"] is None, grads


@pytest.mark.parametrize("name", ["卷积", "conv_é"])
def test_modules_named_in_other_scripts_save_and_load(name, tmp_path):
    """Python identifiers in any script quantized but qp.save refused them ("not a dotted path of
    identifiers"): the check was ASCII-only, and torch.fx's node name for 卷积 ("_") gave the
    quantize after it a dunder name."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module(name, nn.Conv2d(3, 4, 3))
    model.add_module("relu", nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    int8 = qp.quantize(model.eval(), (x,), [(torch.randn(2, 3, 8, 8),) for _ in range(4)], backend="fbgemm")
    loaded = qp.load(qp.save(int8, tmp_path / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(x), int8(x))
    assert name in qp.quantization_report(loaded).kernels


@pytest.mark.parametrize("path", ["__class__", "＿＿class＿＿", "layer.__dict__", "conv-1", "ﬁ"])
def test_a_path_that_is_a_dunder_once_normalised_is_refused(path):
    """Generated code reads ``＿＿class＿＿`` as ``__class__`` (Python normalises identifiers, NFKC)."""
    from qplug_core.errors import ConfigError
    from qplug_core.serialization.graph_codec import check_path

    with pytest.raises(ConfigError, match="is not a dotted path of identifiers or indices"):
        check_path(path, "graph[0].target", "attribute path")


class ConvHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_quantizing_and_loading_under_autocast_computes_as_without_it(backend, tmp_path):
    """Under the caller's bfloat16 autocast fbgemm's convert raised ("Quantize only works on Float
    Tensor") and ONNX Runtime exported bfloat16 casts and compiled nothing (one warning): qplug's
    own runs (capture, convert's checks, a partition's compile at a loaded model's first call)
    compute in float32."""
    torch.manual_seed(0)
    model, x = ConvHead().eval(), torch.randn(4, 3, 8, 8)
    calibration = [(torch.randn(4, 3, 8, 8),) for _ in range(4)]
    plain = qp.quantize(model, (x,), calibration, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = qp.quantize(model, (x,), calibration, backend=backend)
    assert qp.quantization_report(under).kernels == qp.quantization_report(plain).kernels
    loaded = qp.load(qp.save(plain, tmp_path / "model.safetensors"))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = loaded(x)  # a delegate's partition compiles here
        assert torch.equal(under(x), plain(x)) and torch.equal(first, plain(x))


def test_a_pickled_observed_model_is_refused_at_convert_with_the_way_that_works():
    """torch.save of a calibrated model, then convert in another process: "this model was not
    prepared by qplug", although it was; the state_dict route the message now gives converts to
    exactly the model the original converts to."""
    import pickle

    torch.manual_seed(0)  # (a forward annotated as a string, PEP 563, makes torch.fx's pickling fail)
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(288, 4)).eval(), torch.randn(4, 3, 8, 8)
    observed = qp.calibrate(qp.prepare_fx(model, None, (x,), backend="fbgemm"), [(x,)])
    unpickled = pickle.loads(pickle.dumps(observed))
    with pytest.raises(qp.errors.ConfigValidationError, match=r"holds qplug's observers but not the rest of "
                                                              r"qplug's state, which pickling .* load this "
                                                              r"model's state_dict into it"):
        qp.convert_fx(unpickled)
    again = qp.prepare_fx(model, None, (x,), backend="fbgemm")
    again.load_state_dict(unpickled.state_dict())
    with torch.no_grad():
        assert torch.equal(qp.convert_fx(again)(x), qp.convert_fx(observed)(x))


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(torch.relu(self.fc(x))))


@pytest.mark.parametrize("rule", ["name", "regex"])
def test_a_module_name_rule_applies_to_every_call_of_a_shared_module(rule):
    """set_module_name("fc", None) kept only fc's first call float: the second call runs on a
    copy (fc_call1), which the rule did not name, and was lowered to int8 without a word.
    torch.ao keeps both calls float."""
    torch.manual_seed(0)
    mapping = qp.get_default_qconfig_mapping("fbgemm")
    mapping = mapping.set_module_name("fc", None) if rule == "name" else mapping.set_module_name_regex("^fc$", None)
    x = torch.randn(8, 16)
    int8 = qp.quantize(CalledTwice().eval(), (x,), [(torch.randn(8, 16),) for _ in range(4)], backend="fbgemm",
                       qconfig_mapping=mapping)
    report = qp.quantization_report(int8)
    assert sorted(report.quantized) == ["head"]
    assert {s.node for s in report.skipped} >= {"fc", "fc_call1"}


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x, mask=None):  # no annotations: symbolic tracing takes None as an input
        hidden = self.a(x)
        return hidden * mask if mask is not None else hidden


def test_a_none_example_input_is_captured_by_export_and_named_for_symbolic_tracing():
    """forward(x, mask=None) given (x, None): "the model cannot run on the example inputs" (it
    does), with capture="auto" too, which export would have captured."""
    torch.manual_seed(0)
    model, example = OptionalMask().eval(), (torch.randn(4, 16), None)
    calibration = [(torch.randn(4, 16), None) for _ in range(4)]
    int8 = qp.quantize(model, example, calibration, backend="fbgemm")
    assert qp.quantization_report(int8).capture == "export"
    with torch.no_grad():
        assert qp.sqnr(model(*example), int8(*example)) > 30
    with pytest.raises(qp.errors.InputMismatchError, match=r"symbolic tracing takes a None example input .* "
                                                           r"capture='auto' or 'export'"):
        qp.quantize(model, example, calibration, backend="fbgemm", capture="symbolic")


class KeywordHeads(nn.Module):
    """Detection-style heads in a ModuleDict whose keys are Python keywords."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.heads = nn.ModuleDict({"class": nn.Linear(16, 4), "in": nn.Linear(16, 2)})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.heads["class"](features), self.heads["in"](features)


@pytest.mark.parametrize(("capture", "backend"),
                         [("symbolic", "fbgemm"), ("export", "fbgemm"), ("symbolic", "onnxruntime")])
def test_submodules_named_after_python_keywords_quantize_save_and_load(capture, backend, tmp_path):
    """torch.fx wrote ``self.heads.class`` (a SyntaxError), so neither capture could take the
    model (pytorch#188538); the int8 model now runs each head on its kernel and round-trips."""
    model = KeywordHeads().eval()
    x = torch.randn(8, 16)
    int8 = qp.quantize(model, (x,), [(torch.randn(8, 16),) for _ in range(4)], backend=backend, capture=capture)
    for got, want in zip(int8(x), model(x)):
        assert qp.sqnr(want, got) > 30
    loaded = qp.load(qp.save(int8, tmp_path / "model.safetensors"))
    for got, want in zip(loaded(x), int8(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("call", ["quantize-reference", "quantize-onnxruntime", "quantize_dynamic",
                                  "quantize_weights"])
def test_a_model_on_the_meta_device_is_refused_with_how_to_materialize_it(call):
    """fbgemm said "move it with model.cpu()" (which cannot give meta tensors values), the
    reference and delegate backends "cannot run on the example inputs", dynamic Tensor.item()."""
    from qplug_core.errors import ModelStateError

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(4, 8)
    quantize = {"quantize-reference": lambda: qp.quantize(model, (x,), [(x,)], backend="reference"),
                "quantize-onnxruntime": lambda: qp.quantize(model, (x,), [(x,)], backend="onnxruntime"),
                "quantize_dynamic": lambda: qp.quantize_dynamic(model, backend="fbgemm"),
                "quantize_weights": lambda: qp.quantize_weights(model)}[call]
    with pytest.raises(ModelStateError, match=r"meta device, which hold no values: '0.weight'.*to_empty"):
        quantize()


class Annotated(nn.Module):
    """Annotated as in a file with ``from __future__ import annotations`` (this one): strings."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_an_observed_model_of_a_file_with_postponed_annotations_pickles():
    """torch.fx kept the annotation "torch.Tensor" as a global string, and torch.save of the
    observed model raised "'str' object has no attribute '__name__'" (as of torch 2.13)."""
    import io

    x = torch.randn(2, 8)
    observed = qp.prepare_fx(Annotated().eval(), None, (x,), backend="fbgemm")
    buffer = io.BytesIO()
    torch.save(observed, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), observed(x))

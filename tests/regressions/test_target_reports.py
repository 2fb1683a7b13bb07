"""Defects an accuracy-tuning user found (2026-12-06): each test is that user's own call, with the
numbers or the error they rely on."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, SerializationError
from qplug_core.flows.tags import TARGET
from qplug_core.kernels.per_token import PerTokenDynamicLinear

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    with torch.no_grad():
        model[0].weight[:4] *= 40  # a few large output channels, as in trained nets
    return model


def _batches(count: int = 4) -> list[tuple[torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(16, 32),) for _ in range(count)]


def _tuned(fallback: str) -> torch.fx.GraphModule:
    data = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qp.quantize(_mlp(), data[0], data, backend="fbgemm",
                           target=qp.Target(cosine=0.9999, fallback=fallback))


@pytest.mark.parametrize("fallback", ["per_token", "dynamic"])
def test_a_tuned_mlp_with_fused_linear_relu_saves_and_loads_bit_identical(tmp_path, fallback):
    """The per-token linear was set inside the fused LinearReLU that the reference snapshot shares,
    so qp.save met it there: "cannot recover the constructor argument 'weight_int8'"."""
    qmodel = _tuned(fallback)
    assert qmodel.meta[TARGET].decisions and {d.fallback for d in qmodel.meta[TARGET].decisions} <= {
        fallback, "float"}
    if fallback == "per_token":
        assert isinstance(qmodel.get_submodule("0.0"), PerTokenDynamicLinear)
    qp.save(qmodel, tmp_path / "m.safetensors")
    loaded = qp.load(tmp_path / "m.safetensors")
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(qmodel(x), loaded(x))


@pytest.mark.parametrize("reload", [False, True], ids=["in-memory", "loaded"])
def test_export_onnx_of_per_token_layers_computes_what_the_model_does(tmp_path, reload):
    """torch.onnx traced into the per-token layers' oneDNN kernel: "Cannot access data pointer of
    Tensor (e.g. FakeTensor ...)"; they are exported as per-row quantization in ONNX ops."""
    ort = pytest.importorskip("onnxruntime")
    qmodel = _tuned("per_token")
    if reload:
        qp.save(qmodel, tmp_path / "m.safetensors")
        qmodel = qp.load(tmp_path / "m.safetensors")
    path = qp.export_onnx(qmodel, tmp_path / "m.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = _batches(6)[5][0]
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = qmodel(x)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_an_unmet_target_returns_the_best_model_found_not_the_last_try():
    """A criterion no quantization meets (DistilBERT's near-tied neighbours) sent every layer out of
    static int8 for nothing: the last try was returned, as good as all-int8 and slower."""
    data = _batches()

    def unreachable(reference, quantized):
        return 0.0

    with pytest.warns(UserWarning, match="best of the [0-9]+ tried.*the all-int8 model"):
        qmodel = qp.quantize(_mlp(), data[0], data, backend="reference", recipe="none",
                             target=qp.Target(metric=unreachable, minimum=1.0, group="layer"))
    result = qmodel.meta[TARGET]
    assert not result.met and result.quantizations > 1
    assert result.decisions == [] and result.final == result.all_int8
    all_int8 = qp.quantize(_mlp(), data[0], data, backend="reference", recipe="none")
    with torch.no_grad():
        assert torch.equal(qmodel(data[0][0]), all_int8(data[0][0]))


@pytest.mark.parametrize("kwargs,field,shown", [
    ({"sqnr": math.nan}, "sqnr", "nan"), ({"sqnr": math.inf}, "sqnr", "inf"),
    ({"metric": lambda reference, quantized: 0.0, "minimum": math.nan}, "minimum", "nan"),
    ({"cosine": "0.99"}, "cosine", "'0.99'"), ({"cosine": 0.99, "neighbours": True}, "neighbours", "True")])
def test_target_thresholds_must_be_finite_numbers(kwargs, field, shown):
    """NaN and inf ran the whole search to "sqnr 56.08 < nan"; a string raised a raw TypeError."""
    with pytest.raises(ConfigValidationError, match=rf"Target\.{field} must be a finite number, got {shown}$"):
        qp.Target(**kwargs)


def test_auto_prefers_a_backend_whose_search_met_the_target_over_a_faster_one_that_missed():
    """backend="auto" kept the fastest backend although its search missed the target and another
    met it; the user got "target not met" and report.auto did not say which backend met it."""
    from qplug_core.algorithms.target import TARGET_MISSED
    from qplug_core.flows import auto
    from qplug_core.registry.backends import get_backend

    data = _batches()
    bases = []
    for name, target in [("fbgemm", qp.Target(sqnr=200, group="layer")), ("reference", qp.Target(cosine=-1.0))]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the other warnings; the target's miss is held
            with auto.held_target_warnings(TARGET_MISSED) as missed:
                qmodel = qp.quantize(_mlp(), data[0], data, backend=name, recipe="none", target=target)
        bases.append(auto.Calibrated(qmodel, get_backend(name), [], missed))
    assert bases[0].target_warnings and not bases[1].target_warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = auto.choose(bases, [], [], data[0])
    assert chosen is bases[1].model and not [w for w in caught if TARGET_MISSED in str(w.message)]
    trials = {t["backend"]: t for t in qp.quantization_report(chosen).auto}
    assert trials["reference"]["status"] == "chosen"
    assert "met the accuracy target" in trials["reference"]["reason"]
    assert trials["fbgemm"]["reason"].startswith("missed the accuracy target (sqnr ")
    assert "which reference met" in trials["fbgemm"]["reason"]


def test_the_report_counts_per_token_layers_as_int8_and_keeps_the_rungs_through_save_and_load(tmp_path):
    """The report listed the target's per-token layers as float compute, "qconfig is None for this op
    (not requested)"; and qp.load rebuilt that report, the target's decisions gone."""
    qmodel = _tuned("per_token")
    rungs = {layer: d.fallback for d in qmodel.meta[TARGET].decisions for layer in d.layers}
    report = qp.quantization_report(qmodel)
    for layer, rung in rungs.items():
        if rung == "per_token":
            assert report.kernels[layer] == "per-token dynamic int8 (accuracy target)"
            assert layer not in {s.node for s in report.skipped}
        else:
            assert [s.reason for s in report.skipped if s.node == layer] == [
                "the accuracy target took it out of static int8: it runs float"]
    assert "not requested" not in str(report)
    loaded = qp.quantization_report(qp.load(qp.save(qmodel, tmp_path / "m.safetensors")))
    assert (loaded.kernels, loaded.skipped) == (report.kernels, report.skipped)


def test_per_token_layers_are_saved_as_int8_weights_and_load_bit_identical(tmp_path):
    """qp.save wrote the per-token layers' float weights (all-MiniLM-L6-v2: a file 0.49x the float
    weights, not about a quarter) and qp.load quantized them again; files written so still load."""
    from qplug_core.serialization import per_token_record
    from qplug_core.serialization.files import read_artifact_file, write_artifact_file

    qmodel = _tuned("per_token")
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    text, tensors = read_artifact_file(path)
    document = json.loads(text)
    layers = document["model"]["per_token"]
    assert "0" in layers  # the fused LinearReLU's linear too
    for layer in layers:
        assert tensors[f"per_token/{layer}/weight_int8"].dtype == torch.int8
        assert document["model"][per_token_record.KEY][layer]["weight"] not in tensors
    loaded = qp.load(path)
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
    model, tensors = per_token_record.expand(document["model"], tensors)  # as qplug wrote it before
    del model[per_token_record.KEY]
    old = tmp_path / "old.safetensors"
    write_artifact_file(old, json.dumps({**document, "model": model}), tensors)
    assert old.stat().st_size > path.stat().st_size
    with torch.no_grad():
        torch.testing.assert_close(qp.load(old)(x), qmodel(x), rtol=1e-3, atol=1e-3)
    record = document["model"][per_token_record.KEY]
    record[layers[0]]["weight"] = next(iter(model["tensors"]))  # a tensor the file holds otherwise
    text, tensors = read_artifact_file(path)
    write_artifact_file(old, json.dumps(document), tensors)
    with pytest.raises(SerializationError, match="is in the file already"):
        qp.load(old)


def test_per_token_layers_added_to_a_loaded_model_save_as_int8_and_keep_the_earlier_ones(tmp_path):
    """A loaded model given per-token layers (the target's rung, run on qp.load's model) was saved
    with their float weights, and each addition dropped the layers a file already ran per-token."""
    from qplug_core.algorithms.fallbacks import run_per_token
    from qplug_core.serialization import per_token_record
    from qplug_core.serialization.files import read_artifact_file

    data = _batches()
    mapping = qp.get_default_qconfig_mapping("fbgemm").set_module_name("2", None).set_module_name("4", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float layers are said to stay float
        qmodel = qp.quantize(_mlp(), data[0], data, backend="fbgemm", qconfig_mapping=mapping, recipe="none")
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    x = torch.randn(16, 32)
    for layer in ("2", "4"):  # one at a time, each on the model the last file loads into
        loaded = qp.load(path)
        run_per_token(loaded, [layer], simulate=False)
        with torch.no_grad():
            expected = loaded(x)
        path = qp.save(loaded, tmp_path / f"with-{layer}.safetensors")
    text, tensors = read_artifact_file(path)
    model = json.loads(text)["model"]
    assert sorted(model["per_token"]) == sorted(model[per_token_record.KEY]) == ["2", "4"]
    assert {tensors[f"per_token/{layer}/weight_int8"].dtype for layer in ("2", "4")} == {torch.int8}
    loaded = qp.load(path)
    assert sum(isinstance(m, PerTokenDynamicLinear) for m in loaded.modules()) == 2  # 2 inside a LinearReLU
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()

"""qp.quantize runs the model it returns against the float model on a calibration batch: the
convert-time checks score kernels on the example inputs only, so a kernel wrong on another batch
size (torch's int8 upsampling at batch 1, SegFormer's logits cosine 0.31) reached the user with a
report saying nothing. Now the report holds the final model's score beside its reference form's,
and a final model much worse than its reference form is warned about."""

from __future__ import annotations

import warnings

import pytest
import torch
from artifactkit import rewrite

import qplug_core as qp
from qplug_core.errors import SerializationError
from tests.reliability.test_kernel_contract import RawUpsampling, TokensUpsampled

pytestmark = pytest.mark.usefixtures("installed_backends")


def batches(batch: int, n: int = 2) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, 6, 6, generator=gen),) for _ in range(n)]


def quantized(backend: str, calibration_batch: int, **options):
    torch.manual_seed(0)
    model = TokensUpsampled().eval()
    model.labels = ["cat", "dog"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = qp.quantize(model, batches(2)[0], batches(calibration_batch), backend=backend, recipe="none",
                             **options)
    return qmodel, [str(w.message) for w in caught if "reference form against the float model" in str(w.message)]


def test_a_kernel_wrong_on_a_calibration_batch_is_kept_in_reference_form_and_rechecked(register_plugin, tmp_path):
    """The example inputs at batch 2 (the kernel contract passes), the data at batch 1 (torch's
    upsampling misreads the view): the contract run again on that batch keeps the upsampling in
    reference form, the model returned is rechecked, and a warning says what was done."""
    register_plugin(RawUpsampling(), "rawup")
    qmodel, warned = quantized("rawup", calibration_batch=1, preserved_attributes=["labels"])
    report = qp.quantization_report(qmodel)
    check = report.final_check
    assert qmodel.labels == ["cat", "dog"]  # the user's attributes are on the model returned
    assert abs(check["reference_sqnr_db"] - check["sqnr_db"]) < 1 and check["cosine"] > 0.99
    assert len(warned) == 1 and "backend 'rawup'" in warned[0] and "interpolate" in warned[0]
    assert "run in reference form now" in warned[0]
    assert "interpolate" not in report.kernels and "first calibration batch" in report.reference["interpolate"]
    x = batches(1)[0]
    with torch.no_grad():
        assert qp.sqnr(float_model()(*x), qmodel(*x)) > 20  # the model returned is the mended one
    with pytest.warns(UserWarning, match="preserved_attributes"):
        qp.save(qmodel, tmp_path / "m.safetensors")  # and its file loads as mended
    assert "interpolate" in qp.quantization_report(qp.load(tmp_path / "m.safetensors")).reference


def float_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TokensUpsampled().eval()


def test_a_right_backend_is_scored_and_not_warned_about():
    """Above 20 dB against float the reference form is not run (most of the check's cost)."""
    qmodel, warned = quantized("fbgemm", calibration_batch=1)
    report = qp.quantization_report(qmodel)
    assert not warned and report.final_check["sqnr_db"] > 20 and report.final_check["cosine"] > 0.99
    assert report.final_check["reference_sqnr_db"] is None and "reference form: not run" in str(report)


class Counted(torch.nn.Module):
    """TokensUpsampled, counting the calls with real tensors (tracing calls it with proxies)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.calls = float_model(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            self.calls += 1
        return self.inner(x)


def test_the_float_output_calibration_computed_is_reused_and_a_one_pass_iterable_is_checked():
    """The observed model's first calibration call gives the float output: the float model is not
    run again (the check costs one forward of the model returned), so calibration data given as a
    generator is checked too."""
    model = Counted()
    qmodel = qp.quantize(model, batches(2)[0], iter(batches(2)), backend="fbgemm", recipe="none")
    report = qp.quantization_report(qmodel)
    assert model.calls == 0 and report.final_check["sqnr_db"] > 20
    assert not any("not run against the float model" in n for n in report.notes)


def test_convert_fx_checks_the_model_on_the_observed_models_first_call(register_plugin):
    """torch.ao's flow: prepare, calibrate by running the observed model, convert."""
    register_plugin(RawUpsampling(), "rawup")
    observed = qp.prepare_fx(float_model(), None, batches(2)[0], backend="rawup")
    with torch.no_grad():
        for x in batches(1, n=3):
            observed(*x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = qp.convert_fx(observed)
    report = qp.quantization_report(qmodel)
    assert report.final_check["cosine"] > 0.99 and "interpolate" in report.reference
    assert any("run in reference form now" in str(w.message) for w in caught)


def test_an_exported_program_is_checked():
    torch.manual_seed(0)
    program = torch.export.export(float_model(), batches(2)[0])
    qmodel = qp.quantize(program, batches(2)[0], batches(2), backend="fbgemm", recipe="none")
    assert qp.quantization_report(qmodel).final_check["sqnr_db"] > 20


def test_the_check_is_saved_and_loaded_with_the_report_and_older_files_still_load(tmp_path):
    qmodel, _ = quantized("fbgemm", calibration_batch=2)
    qp.save(qmodel, tmp_path / "m.safetensors")
    loaded = qp.load(tmp_path / "m.safetensors")
    assert qp.quantization_report(loaded).final_check == qp.quantization_report(qmodel).final_check
    assert "final model vs float on a calibration batch" in str(qp.quantization_report(loaded))
    def written_before_the_check_was_kept(document, _) -> None:
        document["model"].pop("final_check")
        document.pop("features")

    older = rewrite(tmp_path / "m.safetensors", written_before_the_check_was_kept)
    assert qp.quantization_report(qp.load(older)).final_check == {}


def test_a_reader_without_the_final_check_feature_loads_the_file_without_it(tmp_path, monkeypatch):
    """The check's scores are the file format's first declared optional feature: a qplug-core that
    does not know them (its ``KNOWN`` without them) loads the model, warns what it leaves out."""
    from qplug_core.serialization import format_features

    qmodel, _ = quantized("fbgemm", calibration_batch=2)
    qp.save(qmodel, tmp_path / "m.safetensors")
    monkeypatch.setattr(format_features, "KNOWN", frozenset())
    with pytest.warns(UserWarning, match=r"final_check \(since 0\.1\.0\): the final check's scores"):
        loaded = qp.load(tmp_path / "m.safetensors")
    assert qp.quantization_report(loaded).final_check == {}
    assert torch.equal(loaded(*batches(2)[0]), qmodel(*batches(2)[0]))


@pytest.mark.parametrize("edit", [{"cosine": "1; import os"}, {"output": "x\nnote: all good"},
                                  {"sqnr_db": None}, {"derived": "pooled embedding"}])
def test_a_tampered_check_in_a_file_is_refused_naming_the_field(tmp_path, edit):
    qmodel, _ = quantized("fbgemm", calibration_batch=2)
    qp.save(qmodel, tmp_path / "m.safetensors")
    path = rewrite(tmp_path / "m.safetensors", lambda document, _: document["model"]["final_check"].update(edit))
    with pytest.raises(SerializationError, match=r"model\.final_check"):
        qp.load(path)


class Encoder(torch.nn.Module):
    """A sentence encoder's shape: token states for ids and an attention mask (1 = real token)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(100, 16), torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(input_ids)) * attention_mask.unsqueeze(-1)


def test_a_target_scoring_the_pooled_embedding_has_it_reported_beside_the_token_states():
    """MiniLM's line showed the token states' cosine, which its target does not score: the pooled
    embedding's, which it does, is reported too (and named as what the target scores)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 100, (4, 10), generator=gen), torch.ones(4, 10, dtype=torch.long)) for _ in range(2)]
    for _, mask in data:
        mask[1::2, 7:] = 0
    qmodel = qp.quantize(Encoder().eval(), data[0], data, backend="fbgemm", recipe="none",
                         target=qp.Target(cosine=0.5))
    report = qp.quantization_report(qmodel)
    check = report.final_check
    assert check["derived"] == "pooled embedding" and 0.9 < check["derived_cosine"] <= 1 + 1e-9
    assert "pooled embedding (what the accuracy target scores): cosine" in str(report)
    plain = qp.quantize(Encoder().eval(), data[0], data, backend="fbgemm", recipe="none")
    assert "derived" not in qp.quantization_report(plain).final_check  # no target, nothing derived


def test_a_model_far_from_the_float_model_without_a_target_is_warned_about_once():
    """Outputs under one int8 step (zoo MobileNetV2 at random init: cosine 0.00) were in the report only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    with torch.no_grad():
        model[2].weight.mul_(1e-9)
        model[2].bias.zero_()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = qp.quantize(model, data[0], data, backend="fbgemm", recipe="none")
    far = [str(w.message) for w in caught if "does not reproduce the float model" in str(w.message)]
    assert qp.quantization_report(qmodel).final_check["cosine"] < 0.9
    assert len(far) == 1 and "target=qp.Target(" in far[0] and "qp.compare(" in far[0]

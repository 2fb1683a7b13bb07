"""qp.quantize runs the model it returns against the float model on a calibration batch: the
convert-time checks score kernels on the example inputs only, so a kernel wrong on another batch
size (torch's int8 upsampling at batch 1, SegFormer's logits cosine 0.31) reached the user with a
report saying nothing. Now the report holds the final model's score beside its reference form's,
and a final model much worse than its reference form is warned about."""

from __future__ import annotations

import warnings

import pytest
import torch

import qplug_core as qp
from tests.reliability.test_kernel_contract import RawUpsampling, TokensUpsampled

pytestmark = pytest.mark.usefixtures("installed_backends")


def batches(batch: int, n: int = 2) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, 6, 6, generator=gen),) for _ in range(n)]


def quantized(backend: str, calibration_batch: int):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = qp.quantize(TokensUpsampled().eval(), batches(2)[0], batches(calibration_batch),
                             backend=backend, recipe="none")
    return qmodel, [str(w.message) for w in caught if "reference form against the float model" in str(w.message)]


def test_a_kernel_right_on_the_example_but_wrong_on_a_calibration_batch_is_warned_about(register_plugin):
    """The example inputs at batch 2 (the kernel contract passes), the data at batch 1 (torch's
    upsampling misreads the view): the final model's score says it and a warning names the backend."""
    register_plugin(RawUpsampling(), "rawup")
    qmodel, warned = quantized("rawup", calibration_batch=1)
    check = qp.quantization_report(qmodel).final_check
    assert check["reference_sqnr_db"] - check["sqnr_db"] > 6
    assert len(warned) == 1 and "backend 'rawup'" in warned[0] and "qp.compare" in warned[0]
    assert "final model vs float on a calibration batch: cosine" in str(qp.quantization_report(qmodel))


def test_a_right_backend_is_scored_and_not_warned_about():
    """Above 20 dB against float the reference form is not run (most of the check's cost)."""
    qmodel, warned = quantized("fbgemm", calibration_batch=1)
    report = qp.quantization_report(qmodel)
    assert not warned and report.final_check["sqnr_db"] > 20 and report.final_check["cosine"] > 0.99
    assert report.final_check["reference_sqnr_db"] is None and "reference form: not run" in str(report)


def test_a_one_pass_iterable_says_the_model_was_not_checked():
    torch.manual_seed(0)
    qmodel = qp.quantize(TokensUpsampled().eval(), batches(2)[0], iter(batches(2)), backend="fbgemm",
                         recipe="none")
    report = qp.quantization_report(qmodel)
    assert not report.final_check and any("not run against the float model" in n for n in report.notes)

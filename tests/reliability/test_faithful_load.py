"""Load rebuilds the model as it was saved, or refuses saying why (issue 25).

A region a backend could not run at convert stays in reference form, and the file records it. Load
cannot re-check kernels (the kernel contract needs the example inputs, which a file does not hold),
so before the record a region refused at convert ran on the refused kernel after load, and the
loaded model answered differently. The third-party plugin here is really installed and its linear
kernel is wrong (negated outputs), as in test_kernel_contract.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from artifactkit import rewrite
from test_kernel_contract import images, install_wonky, model

import qplug_core as qp
from qplug_core.errors import SerializationError

pytestmark = pytest.mark.usefixtures("installed_backends")


def _converted(fake_dist, monkeypatch):
    install_wonky(fake_dist, monkeypatch, "negated")
    observed = qp.calibrate(qp.prepare_fx(model(), None, images(1)[0], backend="wonky"), images())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the contract's warning: test_kernel_contract checks it
        return qp.convert_fx(observed)


def test_a_region_refused_at_convert_stays_in_reference_form_after_load(fake_dist, monkeypatch, tmp_path):
    converted = _converted(fake_dist, monkeypatch)
    assert "broke the kernel contract" in qp.quantization_report(converted).reference["fc"]
    path = qp.save(converted, tmp_path / "model.safetensors")
    loaded = qp.load(path)
    report = qp.quantization_report(loaded)
    assert "fc" not in report.kernels and "broke the kernel contract" in report.reference["fc"]
    assert report.kernels == qp.quantization_report(converted).kernels
    for (x,) in images(2, seed=7):
        assert torch.equal(loaded(x), converted(x))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_a_record_the_backend_cannot_rebuild_is_refused_naming_the_ops(fake_dist, monkeypatch, tmp_path):
    path = qp.save(_converted(fake_dist, monkeypatch), tmp_path / "model.safetensors")

    def claim_more(document, tensors) -> None:
        document["model"]["lowering"]["kernels"]["ghost"] = "quantized::linear"

    with pytest.raises(SerializationError, match=r"backend 'wonky' cannot rebuild the model as it was saved: "
                                                 r"1 int8 op\(s\) ran on backend kernels when saved but would "
                                                 r"stay in reference form now \(ghost: not lowered\).*"
                                                 r"backend='reference'"):
        qp.load(rewrite(path, claim_more))
    assert qp.quantization_report(qp.load(path, backend="reference")).backend == "reference"


def test_a_malformed_record_is_refused_naming_the_field(fake_dist, monkeypatch, tmp_path):
    path = qp.save(_converted(fake_dist, monkeypatch), tmp_path / "model.safetensors")

    def break_record(document, tensors) -> None:
        document["model"]["lowering"]["reference"]["fc"] = 7

    with pytest.raises(SerializationError, match=r"model\.lowering\.reference\.fc.*a string"):
        qp.load(rewrite(path, break_record))

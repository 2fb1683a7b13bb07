"""G9: model-level quality gate on the toy zoo (reference backend, fixed seeds).

Each model's output SQNR against float on held-out inputs must stay within 1 dB of the recorded
baseline (``sqnr_baseline.json``), so a change that quietly degrades quantization quality fails CI.
Where int8 can reach it, the guarantee's 25 dB floor is asserted too; random-weight MobileNetV2
amplifies noise through its depth for any int8 tool (torch.ao gets ~10 dB), so only the baseline
applies to it. Regenerate the baseline deliberately with QPLUG_UPDATE_SQNR_BASELINE=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import qplug_core as qp
from qplug_core.testing import one_thread
from qplug_core.zoo import get_model
from qplug_core.zoo.batchnorm import calibrate_batchnorm

BASELINE = Path(__file__).with_name("sqnr_baseline.json")
FLOOR_DB = 25.0
ALLOWED_DROP_DB = 1.0


def _images(seed: int, n: int, size: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, size, size, generator=g),) for _ in range(n)]


def _tokens(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (2, 16), generator=g)
        mask = torch.ones(2, 16)
        mask[:, 12:] = 0
        batches.append((ids, mask))
    return batches


def _digits(seed: int, n: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 8, 8, generator=g),) for _ in range(n)]


def _mobilenet():
    model = get_model("mobilenet_v2", seed=0)
    return calibrate_batchnorm(model, _images(7, 2, 64)).eval()


def _sequences(seed: int, n: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 12, 32, generator=g),) for _ in range(n)]


MODELS = {
    # name: (model factory, data factory(seed, n), reaches the 25 dB floor)
    "digits_cnn": (lambda: get_model("digits_cnn", seed=0), _digits, True),
    "resnet18_96px": (lambda: get_model("resnet18", seed=0), lambda s, n: _images(s, n, 96), True),
    "mobilenet_v2_64px": (_mobilenet, lambda s, n: _images(s, n, 64), False),
    "bert_encoder": (lambda: qp.zoo.transformer.make_realistic_bert(seed=0), _tokens, True),
    "lstm_classifier": (lambda: get_model("lstm_classifier", seed=0), _sequences, True),
}


def _measure(name: str) -> float:
    make_model, make_data, _ = MODELS[name]
    torch.manual_seed(0)
    model = make_model().eval()
    calibration, held_out = make_data(1, 4), make_data(2, 2)
    qmodel = qp.quantize(model, calibration[0], calibration, backend="reference")
    with torch.no_grad():
        expected = torch.cat([model(*batch) for batch in held_out])
        got = torch.cat([qmodel(*batch) for batch in held_out])
    return qp.sqnr(expected, got)


@pytest.fixture(scope="module")
def baseline() -> dict[str, float]:
    return json.loads(BASELINE.read_text()) if BASELINE.exists() else {}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_sqnr_holds_its_baseline(name, baseline):
    with one_thread():
        measured = _measure(name)
    if os.environ.get("QPLUG_UPDATE_SQNR_BASELINE") == "1":
        data = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
        data[name] = round(measured, 2)
        BASELINE.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    assert name in baseline, f"no baseline for {name}: run with QPLUG_UPDATE_SQNR_BASELINE=1"
    assert measured >= baseline[name] - ALLOWED_DROP_DB, (
        f"{name}: output SQNR {measured:.2f} dB dropped more than {ALLOWED_DROP_DB} dB below its "
        f"baseline {baseline[name]:.2f} dB")
    if MODELS[name][2]:
        assert measured >= FLOOR_DB

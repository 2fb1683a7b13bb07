"""Issue 24: a file converted on a CPU whose int8 products accumulate in int32 (VNNI), loaded on
one whose kernels sum u8 x s8 pairs in int16 (x86 without VNNI), must not saturate there: fbgemm's
layers with 8-bit weights get 7-bit ones at load, with a warning; a file converted on such a CPU
(bits chosen per layer on data there) loads as it was. Decisions under overridden flags, fbgemm's
kernels for real on the host."""

from __future__ import annotations

import warnings

import pytest
import torch

import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags
from tests.reliability.test_int16_pair_sums import AVX2, VNNI

pytestmark = pytest.mark.usefixtures("installed_backends")


@pytest.fixture(scope="module")
def digits():
    model = qp.zoo.get_model("digits_cnn", seed=0)
    data = [qp.zoo.example_inputs("digits_cnn", batch=8, seed=seed) for seed in range(3)]
    return model, data


def _converted(flags, digits, convert=qp.convert_fx):
    model, data = digits
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, data[0], backend="fbgemm")
        qp.calibrate(observed, data)
        return convert(observed)


def _loaded(path, flags):
    with override_cpu_flags(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = qp.load(path)
    return loaded, [str(w.message) for w in caught if "7-bit" in str(w.message)]


def _weight_codes(model) -> dict[str, int]:
    """Largest |weight integer| of each packed fbgemm layer."""
    return {name: int(module._packed.unpack()[0].int_repr().abs().max())
            for name, module in model.named_modules() if hasattr(module, "_packed")}


def test_a_vnni_file_loads_with_7_bit_weights_where_pairs_sum_in_int16(digits, tmp_path):
    converted = _converted(VNNI, digits)
    assert max(_weight_codes(converted).values()) == 127
    path = qp.save(converted, tmp_path / "digits.qplug")
    loaded, messages = _loaded(path, AVX2)
    (message,) = messages
    assert "was converted where int8 products accumulate in int32 (VNNI)" in message
    assert "backend 'fbgemm''s kernels sum u8 x s8 pairs in int16" in message
    assert "quantize again on this CPU" in message
    assert set(_weight_codes(loaded).values()) == {64}  # every weighted layer: [-64, 64]
    model, _ = digits
    held_out = qp.zoo.example_inputs("digits_cnn", batch=64, seed=7)
    # 8 bits as a VNNI CPU computes them: the reference form (on a CPU without VNNI the converted
    # model's own 8-bit kernels saturate, which is what loading with 7-bit weights prevents)
    eight_bits = _converted(VNNI, digits, qp.convert_to_reference_fx)
    with torch.no_grad():
        expected = model(*held_out)
        eight, seven = qp.sqnr(expected, eight_bits(*held_out)), qp.sqnr(expected, loaded(*held_out))
    assert eight - 3 < seven < eight  # one bit of weights, not saturated pairs
    assert qp.save(loaded, tmp_path / "again.qplug").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("flags", [VNNI, AVX2], ids=["vnni", "avx2"])
def test_a_file_loads_as_converted_on_the_same_kind_of_cpu(digits, tmp_path, flags):
    converted = _converted(flags, digits)
    path = qp.save(converted, tmp_path / "digits.qplug")
    loaded, messages = _loaded(path, flags)
    assert messages == [] and _weight_codes(loaded) == _weight_codes(converted)
    x = qp.zoo.example_inputs("digits_cnn", batch=16, seed=8)
    with torch.no_grad():
        assert torch.equal(loaded(*x), converted(*x))

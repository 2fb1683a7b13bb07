"""A target on SwinV2 is met: the search goes past the layers whose local error is above the
median when those are not enough (issue 30: it stopped at cosine 0.9974 < 0.998 with the query,
value and downsampling linears never tried)."""

from __future__ import annotations

import pytest
import torch

import qplug_core as qp
from qplug_core.flows.tags import TARGET

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]

VNNI = "avx2 avx512f avx512bw avx512_vnni"


def test_swinv2_meets_its_target_on_held_out_images():
    from qplug_core.plugin_api import override_cpu_flags
    from tests.support.hf_families import build_family, family_inputs

    model = build_family("swinv2")
    calibration = [family_inputs("swinv2", seed=s) for s in range(1, 9)]
    with override_cpu_flags(VNNI):  # the per-token rung (this CPU's ladder decides it)
        qmodel = qp.quantize(model, calibration[0], calibration, backend="fbgemm",
                             target=qp.Target(cosine=0.998), progress=False)
    result = qmodel.meta[TARGET]
    assert result.all_int8.cosine_mean < 0.995 and result.met and result.final.cosine_mean >= 0.998
    # a conv has no dynamic rung: the patch embedding (whose error every block carries) is float
    assert "model.embeddings.patch_embeddings.projection" in result.float_layers
    with torch.no_grad():
        held = [family_inputs("swinv2", seed=s) for s in range(50, 54)]
        want = torch.cat([model(*b).flatten(1) for b in held])
        got = torch.cat([qmodel(*b).flatten(1) for b in held])
    assert torch.nn.functional.cosine_similarity(want, got, dim=1).mean() >= 0.998


def test_swinv2_meets_its_target_without_a_fast_per_token_gemm_by_taking_the_weak_fallbacks_to_float(
        monkeypatch):
    """Where per-token's GEMM is slow (only ``torch._int_mm``: x86 without AVX2) the ladder is
    (per-tensor dynamic, float): every layer out on its first passing rung still gave 0.9948, and
    the search stopped there with a warning. Now the dynamic layers that lose most go on to float
    until the target holds. The rest is decided as on an AVX2 CPU without VNNI, whose weights any
    x86 host's fbgemm kernels compute exactly."""
    import warnings

    from qplug_core.algorithms import fallbacks
    from qplug_core.plugin_api import override_cpu_flags

    monkeypatch.setattr(fallbacks, "per_token_is_fast", lambda: False)
    from tests.support.hf_families import build_family, family_inputs

    model = build_family("swinv2")
    calibration = [family_inputs("swinv2", seed=s) for s in range(1, 9)]
    # the recipe SwinV2 had before it counted as a transformer: with SmoothQuant (its default now)
    # this ladder ends short of the target even with every layer out, on the int8 matmuls and adds
    # of smoothed activations, and says so (session 28's note)
    with override_cpu_flags("fpu sse2 avx avx2 fma"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        qmodel = qp.quantize(model, calibration[0], calibration, backend="fbgemm", recipe="bias_correction",
                             target=qp.Target(cosine=0.998), progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert not [m for m in said if "accuracy target not met" in m]
    # met, but with every layer out: the user is told it is likely no faster than float
    assert [m for m in said if "met only with every weighted layer (26) out of static int8" in m]
    result = qmodel.meta[TARGET]
    assert result.met and result.final.cosine_mean >= 0.998
    assert any("float once every layer was out of static int8" in d.reason for d in result.decisions)
    assert {d.fallback for d in result.decisions} <= {"dynamic", "float"}  # no per-token rung here
    with torch.no_grad():
        held = [family_inputs("swinv2", seed=s) for s in range(50, 54)]
        want = torch.cat([model(*b).flatten(1) for b in held])
        got = torch.cat([qmodel(*b).flatten(1) for b in held])
    assert torch.nn.functional.cosine_similarity(want, got, dim=1).mean() >= 0.998

"""Issue 7: every pattern config of fbgemm, quantized end to end and compared with the reference.

One generated model per config (``qplug_core.testing.pattern_cases``): the pattern must be matched,
quantized, lowered to fbgemm's kernel when the kernel table has one, and agree with
``convert_to_reference_fx`` of the same observed model within one quantization step on >= 99% of
the output elements.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from qplug_core import plugins
from qplug_core.backend import get_backend
from qplug_core.testing import cases_for, check_pattern

try:
    importlib.metadata.version("qplug-fbgemm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("qplug-fbgemm is not installed (pip install -e plugins/qplug_fbgemm)",
                allow_module_level=True)

BACKEND = "fbgemm"


def _with_plugins_loaded():
    with pytest.MonkeyPatch.context() as mp:
        for name in (plugins.ENV_LOAD, plugins.ENV_DISABLE, plugins.ENV_STRICT):
            mp.delenv(name, raising=False)
        plugins.reset()
        try:
            return cases_for(BACKEND) if get_backend(BACKEND).availability().ok else []
        finally:
            plugins.reset()


CASES = _with_plugins_loaded()


def _params():
    for case in CASES:
        marks = []
        if case.skip_reason:
            marks.append(pytest.mark.skip(reason=case.skip_reason))
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="module")
def backend():
    """fbgemm assembled once for the module, with every installed plugin loaded, on one thread."""
    with pytest.MonkeyPatch.context() as mp:
        for name in (plugins.ENV_LOAD, plugins.ENV_DISABLE, plugins.ENV_STRICT):
            mp.delenv(name, raising=False)
        plugins.reset()
        chosen = get_backend(BACKEND)
        if not chosen.availability().ok:
            pytest.skip(f"fbgemm unavailable: {chosen.availability().reason}")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: threads only add contention on shared CI machines
        yield chosen
        torch.set_num_threads(threads)
        plugins.reset()


def test_one_case_per_pattern_config(backend):
    patterns = [c.pattern_complex_format for c in backend.config.configs]
    assert [case.pattern for case in CASES] == patterns
    assert len({case.id for case in CASES}) == len(CASES)
    assert len(CASES) >= 198


@pytest.mark.parametrize("case", _params())
def test_pattern_lowers_and_matches_reference(backend, case):
    result = check_pattern(backend, case)
    assert result.ok, result.explain()
    assert result.matched and result.outputs
    if result.expect_kernel:  # the kernel table has this pattern: its anchor runs on the kernel
        assert result.anchors and set(result.anchors) <= set(result.kernels), result.explain()


def test_static_float_conv_bn_module_converts(backend):
    import qplug_core as qp
    from qplug_core.nn import intrinsic as nni

    model = torch.nn.Sequential(nni.ConvBn2d(torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4))).eval()
    x = torch.randn(2, 4, 6, 6)
    observed = qp.prepare_fx(model, None, (x,), backend=backend)
    qp.calibrate(observed, [(x,)])
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    with torch.no_grad():
        expected, got = reference(x), lowered(x)
    step = float(expected.max() - expected.min()) / 255 * 1.01
    assert ((got - expected).abs() <= step).float().mean() >= 0.99

"""A ready pytest suite proving every pattern config of a backend end to end.

The fbgemm and qnnpack plugins run it, and a third-party backend can too: in a test module write
``globals().update(pattern_suite("mynpu", "qplug-mynpu"))``. Each pattern gets a generated model
(:func:`~qplug_core.testing.pattern_cases.cases_for`) that must be matched, quantized, lowered to the
backend's kernel when its kernel table has one, and agree with ``convert_to_reference_fx`` of the
same observed model within one quantization step on >= 99% of the output elements. Each case also
runs at the ATen level (``capture="export"``, :mod:`~qplug_core.testing.pattern_levels`), marked
slow; the families the ATen level does not reach are skipped with the reason.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

import qplug_core as qp
from qplug_core.backend import get_backend
from qplug_core.nn import intrinsic as nni
from qplug_core.testing.environment import (
    all_plugins_loaded,
    one_thread,
    require_distribution,
)
from qplug_core.testing.pattern_cases import PatternCase, cases_for, check_pattern
from qplug_core.testing.pattern_levels import check_export_level, export_gap


def pattern_suite(backend_name: str, distribution: str) -> dict[str, Any]:
    """The fixture and tests to put into a test module's globals (see the module docstring)."""
    require_distribution(distribution)
    with all_plugins_loaded():
        available = get_backend(backend_name).availability().ok
        cases: list[PatternCase] = cases_for(backend_name) if available else []

    def params(export_level: bool = False) -> Iterator[Any]:
        for case in cases:
            reason = case.skip_reason or (export_gap(case) if export_level else None)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            if export_level:
                marks.append(pytest.mark.slow)
            yield pytest.param(case, id=case.id, marks=marks)

    @pytest.fixture(scope="module")
    def backend():
        """The backend assembled once, with every installed plugin loaded, on one thread."""
        with all_plugins_loaded(), one_thread():
            chosen = get_backend(backend_name)
            if not chosen.availability().ok:
                pytest.skip(f"{backend_name} unavailable: {chosen.availability().reason}")
            yield chosen

    def test_one_case_per_pattern_config(backend):
        patterns = [c.pattern_complex_format for c in backend.config.configs]
        assert [case.pattern for case in cases] == patterns
        assert len({case.id for case in cases}) == len(cases)

    @pytest.mark.parametrize("case", list(params()))
    def test_pattern_lowers_and_matches_reference(backend, case):
        result = check_pattern(backend, case)
        assert result.ok, result.explain()
        assert result.matched and result.outputs
        if result.expect_kernel:  # the kernel table has this pattern: its anchor runs on the kernel
            assert result.anchors and set(result.anchors) <= set(result.kernels), result.explain()

    @pytest.mark.parametrize("case", list(params(export_level=True)))
    def test_pattern_same_at_export_level(backend, case):
        """The case's model captured with torch.export runs the kernels symbolic tracing gives."""
        problems = check_export_level(backend, case)
        assert not problems, f"{case.id} on {backend.name} at the export level: {problems}"

    def test_static_float_conv_bn_module_converts(backend):
        model = torch.nn.Sequential(nni.ConvBn2d(torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4)))
        x = torch.randn(2, 4, 6, 6)
        observed = qp.prepare_fx(model.eval(), None, (x,), backend=backend)
        qp.calibrate(observed, [(x,)])
        reference, lowered = qp.convert_to_reference_fx(observed), qp.convert_fx(observed)
        with torch.no_grad():
            expected, got = reference(x), lowered(x)
        step = float(expected.max() - expected.min()) / 255 * 1.01
        assert ((got - expected).abs() <= step).float().mean() >= 0.99

    return {"backend": backend, "test_one_case_per_pattern_config": test_one_case_per_pattern_config,
            "test_pattern_lowers_and_matches_reference": test_pattern_lowers_and_matches_reference,
            "test_pattern_same_at_export_level": test_pattern_same_at_export_level,
            "test_static_float_conv_bn_module_converts": test_static_float_conv_bn_module_converts}

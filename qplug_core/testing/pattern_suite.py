"""``BackendPatternSuite``: a ready pytest suite proving every pattern config of a backend end to end.

The fbgemm and qnnpack plugins run it, and a third-party backend can too::

    from qplug_core.plugin_api import BackendPatternSuite

    class TestPatterns(BackendPatternSuite):
        backend = "mynpu"
        distribution = "qplug-mynpu"

Each pattern gets a generated model (:func:`~qplug_core.testing.pattern_cases.cases_for`) that must
be matched, quantized, lowered to the backend's kernel when its kernel table has one, and agree with
``convert_to_reference_fx`` of the same observed model within one quantization step on >= 99% of the
output elements. Each case also runs at the ATen level (``capture="export"``,
:mod:`~qplug_core.testing.pattern_levels`), marked slow; the families the ATen level does not reach
are skipped with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, ClassVar, Iterator

import pytest
import torch

import qplug_core as qp
from qplug_core.nn import intrinsic as nni
from qplug_core.testing.environment import (
    all_plugins_loaded,
    one_thread,
    require_distribution,
)
from qplug_core.testing.pattern_cases import PatternCase, cases_for, check_pattern
from qplug_core.testing.pattern_levels import check_export_level, export_gap


@functools.lru_cache(maxsize=None)
def _cases(backend_name: str) -> tuple[PatternCase, ...]:
    with all_plugins_loaded():
        available = qp.get_backend(backend_name).availability().ok
        return tuple(cases_for(backend_name)) if available else ()



class BackendPatternSuite:
    """Subclass it in a test module and set ``backend`` and ``distribution`` (see the module doc)."""

    backend: ClassVar[str]
    #: the distribution that must be installed for the suite to run (it skips otherwise)
    distribution: ClassVar[str]
    #: case ids to run (``None``: every case); a compiling backend whose cases each take seconds
    #: (an ONNX export and a compile) runs a sample covering the primitives it maps to
    only: ClassVar[frozenset[str] | None] = None
    #: case id -> why it fails on this backend: run as a strict xfail, so a fix shows
    known_failures: ClassVar[dict[str, str]] = {}
    #: the same for the export-level (torch.export) run of a case
    known_export_failures: ClassVar[dict[str, str]] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", list(self._params()))
        if "export_case" in metafunc.fixturenames:
            metafunc.parametrize("export_case", list(self._params(export_level=True)))

    @classmethod
    def _params(cls, export_level: bool = False) -> Iterator[Any]:
        try:
            importlib.metadata.version(cls.distribution)
        except importlib.metadata.PackageNotFoundError:
            yield pytest.param(None, id="missing", marks=pytest.mark.skip(
                reason=f"{cls.distribution} is not installed (pip install it to run these tests)"))
            return
        for case in _cases(cls.backend):
            if cls.only is not None and case.id not in cls.only:
                continue
            reason = case.skip_reason or (export_gap(case) if export_level else None)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            known = cls.known_export_failures if export_level else cls.known_failures
            if case.id in known:
                marks.append(pytest.mark.xfail(strict=True, reason=known[case.id]))
            if export_level:
                marks.append(pytest.mark.slow)
            yield pytest.param(case, id=case.id, marks=marks)

    @pytest.fixture(scope="class")
    @classmethod
    def suite_backend(cls):
        """The backend assembled once, with every installed plugin loaded, on one thread."""
        require_distribution(cls.distribution)
        with all_plugins_loaded(), one_thread():
            chosen = qp.get_backend(cls.backend)
            if not chosen.availability().ok:
                pytest.skip(f"{cls.backend} unavailable: {chosen.availability().reason}")
            yield chosen

    def test_one_case_per_pattern_config(self, suite_backend):
        patterns = [c.pattern_complex_format for c in suite_backend.config.configs]
        cases = _cases(self.backend)
        assert [case.pattern for case in cases] == patterns
        assert len({case.id for case in cases}) == len(cases)
        unknown = (set(self.only or ()) | set(self.known_failures)
                   | set(self.known_export_failures)) - {case.id for case in cases}
        assert not unknown, f"only / known_failures name no case of {self.backend!r}: {sorted(unknown)}"

    def test_pattern_lowers_and_matches_reference(self, suite_backend, case):
        result = check_pattern(suite_backend, case)
        assert result.ok, result.explain()
        assert result.matched and result.outputs
        if result.expect_kernel:  # the kernel table has this pattern: its anchor runs on the kernel
            assert result.anchors and set(result.anchors) <= set(result.kernels), result.explain()

    def test_pattern_same_at_export_level(self, suite_backend, export_case):
        """The case's model captured with torch.export runs the kernels symbolic tracing gives."""
        problems = check_export_level(suite_backend, export_case)
        assert not problems, f"{export_case.id} on {suite_backend.name} at the export level: {problems}"

    def test_static_float_conv_bn_module_converts(self, suite_backend):
        model = torch.nn.Sequential(nni.ConvBn2d(torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4)))
        x = torch.randn(2, 4, 6, 6)
        observed = qp.prepare_fx(model.eval(), None, (x,), backend=suite_backend)
        qp.calibrate(observed, [(x,)])
        # a backend without conv patterns leaves it float: then both forms are the float model
        reference = qp.convert_to_reference_fx(observed, allow_float=True)
        lowered = qp.convert_fx(observed, allow_float=True)
        with torch.no_grad():
            expected, got = reference(x), lowered(x)
        step = float(expected.max() - expected.min()) / 255 * 1.01
        assert ((got - expected).abs() <= step).float().mean() >= 0.99



__all__ = ["BackendPatternSuite"]

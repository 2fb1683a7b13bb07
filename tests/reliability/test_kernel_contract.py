"""The kernel contract enforced at convert (issue 17), against a really installed third-party plugin
whose linear kernel is wrong: wrong shape, NaN, wrong values or an exception each make that region
fall back to the reference form, with a warning naming the plugin; correct kernels are kept."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows import kernel_check as kernel_contract
from qplug_core.plugin_api import BackendPatternConfig, BackendPlugin, KernelSpec, ObservationType
from qplug_core.registry import plugins

pytestmark = pytest.mark.usefixtures("installed_backends")

WONKY_PLUGIN = """
import dataclasses

import torch
from qplug_core.plugin_api import BackendPlugin

FAULT = {fault!r}


class WrongLinear(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        out = self.inner(*args)
        if FAULT == "shape":
            return out[..., :-1]
        if FAULT == "nan-float":
            return torch.full(out.shape, float("nan"))
        if FAULT == "nan":
            return out * float("nan")
        if FAULT == "negated":
            return torch.quantize_per_tensor(-out.dequantize(), out.q_scale(), out.q_zero_point(),
                                             out.dtype)
        if FAULT == "raises":
            raise RuntimeError("unsupported tile size")
        return out


class Wonky(BackendPlugin):
    \"\"\"fbgemm's patterns and kernels, with a wrong linear kernel.\"\"\"

    name = "wonky"
    description = "fbgemm with a wrong linear kernel"
    engine = "fbgemm"

    def kernels(self):
        return {{key: dataclasses.replace(spec, build=lambda ctx, build=spec.build: WrongLinear(build(ctx)))
                if spec.op in ("quantized::linear", "quantized::linear_dynamic") else spec
                for key, spec in super().kernels().items()}}


plugin = Wonky()
"""


class ConvThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def model() -> ConvThenLinear:
    torch.manual_seed(0)
    return ConvThenLinear().eval()


def images(n: int = 3, seed: int = 1) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, 8, 8, generator=gen),) for _ in range(n)]


def install_wonky(fake_dist, monkeypatch, fault: str) -> None:
    fake_dist("qplug-wonky", WONKY_PLUGIN.format(fault=fault), module="qplug_wonky:plugin")
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-wonky,qplug-fbgemm")
    plugins.reset()


def one_step(reference: torch.Tensor) -> float:
    return 2 * float(reference.abs().max()) / 255


@pytest.mark.parametrize("fault, problem", [
    ("shape", r"it returned shape \(2, 4\), expected \(2, 5\)"),
    ("nan-float", r"it returned dtype torch.float32, expected torch.quint8"),
    ("negated", r"10 of 10 outputs differ from the reference by more than 2 quantization steps"),
    ("raises", r"it raised RuntimeError: unsupported tile size"),
])
def test_wrong_static_kernel_falls_back_to_the_reference_form(fake_dist, monkeypatch, fault, problem):
    install_wonky(fake_dist, monkeypatch, fault)
    observed = qp.calibrate(qp.prepare_fx(model(), None, images(1)[0], backend="wonky"), images())
    with pytest.warns(UserWarning, match=r"qplug: backend 'wonky', node 'fc': kernel quantized::linear "
                                         r"of plugin 'wonky' \(qplug-wonky 0.1\) broke the kernel "
                                         rf"contract on the example inputs \({problem}"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert "fc" not in report.kernels and report.kernels["conv"].startswith("quantized::conv2d")
    assert "broke the kernel contract" in report.reference["fc"]
    assert "fc" in {s.node for s in report.skipped}  # G5: the fallback is reported
    reference = qp.convert_to_reference_fx(observed)
    for (x,) in images(2, seed=7):  # the model is still right: within one step of the reference
        expected = reference(x)
        assert (lowered(x) - expected).abs().max() <= one_step(expected) + 1e-6


def test_wrong_dynamic_kernel_returning_nan_falls_back(fake_dist, monkeypatch):
    install_wonky(fake_dist, monkeypatch, "nan")
    mapping = qp.get_default_qconfig_mapping("wonky", "dynamic")
    observed = qp.prepare_fx(model(), mapping, images(1)[0], backend="wonky")
    with pytest.warns(UserWarning, match=r"node .fc.: kernel quantized::linear\S* of plugin .wonky. "
                                         r"\(qplug-wonky 0.1\) broke the kernel contract on the "
                                         r"example inputs \(it returned 10 non-finite value\(s\)\)"):
        lowered = qp.convert_fx(observed)
    x = images(1, seed=3)[0][0]
    assert torch.isfinite(lowered(x)).all()
    torch.testing.assert_close(lowered(x), qp.convert_to_reference_fx(observed)(x))


def test_a_correct_third_party_kernel_is_kept_silently(fake_dist, monkeypatch, recwarn):
    install_wonky(fake_dist, monkeypatch, "none")
    observed = qp.calibrate(qp.prepare_fx(model(), None, images(1)[0], backend="wonky"), images())
    report = qp.quantization_report(qp.convert_fx(observed))
    assert report.kernels["fc"] == "quantized::linear"
    assert not [w for w in recwarn if "contract" in str(w.message)]


def test_contract_tolerance_is_documented():
    doc = kernel_contract.__doc__
    assert kernel_contract.MAX_STEPS == 2 and "MAX_STEPS" in doc and "MAX_OUTLIER_FRACTION" in doc


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernels")
def test_this_module_passes_on_a_cpu_without_vnni_too():
    """The tests above on FBGEMM's AVX2 kernels with an AVX2 CPU's flags (what CI's Zen 3 machines
    run): a third-party backend on the fbgemm engine gets safe qparams from BackendPlugin's
    defaults there, so its correct kernels are kept (5 of them fell back before, up to 34 steps
    off)."""
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "QPLUG_CPU_FLAGS": "avx2 fma",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "not without_vnni"], env=env, capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


def test_a_kernel_writing_its_input_cannot_change_the_recorded_examples():
    """The recorded example values are shared by every region's check (two linears reading one
    activation); a kernel that writes its input in place, as in-place ops do, made the next check
    compare against inputs the model never produced. Each kernel gets copies."""
    x = torch.randn(4, 8)
    recorded = x.clone()

    class ScribblingRelu(nn.Module):
        def forward(self, value: torch.Tensor) -> torch.Tensor:
            return value.relu_()

    assert kernel_contract.violation(ScribblingRelu(), (x,), {}, torch.relu(recorded), torch.float32,
                                     None) == ""
    assert torch.equal(x, recorded)


def test_a_kernel_is_checked_on_the_layout_the_model_gives_it():
    """The copies keep the recorded strides: a column of a categorical matrix (``x_cat[:, 0]``)
    reached torch's embedding lookup strided at run time, but a contiguous ``clone()`` at the check,
    so a kernel refusing strided indices passed the check and raised at every call."""
    column = torch.arange(12).reshape(4, 3)[:, 0]

    class NeedsContiguous(nn.Module):
        def forward(self, indices: torch.Tensor) -> torch.Tensor:
            if not indices.is_contiguous():
                raise RuntimeError("Expect indices to be contiguous")
            return indices.float()

    assert kernel_contract.violation(NeedsContiguous(), (column,), {}, column.float(), torch.float32, None) \
        == "it raised RuntimeError: Expect indices to be contiguous"


def test_a_quantized_input_keeps_even_the_batch_stride_of_a_view():
    """SegFormer's decoder passes its upsampling a batch-1 view of transposed tokens with batch
    stride C, which torch's kernel misreads; a quantized copy (``clone()``, a backend's quantize)
    is laid out anew, so the check is given the recorded strides exactly."""
    tokens = torch.quantize_per_tensor(torch.randn(1, 20, 8), 0.05, 128, torch.quint8)
    view = tokens.transpose(1, 2).reshape(1, 8, 4, 5)
    for copy in (kernel_contract._copied(view), kernel_contract.with_strides(view.contiguous(), view.stride())):
        assert copy.stride() == view.stride() == (8, 1, 40, 8) and torch.equal(copy.int_repr(), view.int_repr())


class AddOfFarApartScales(nn.Module):
    """``c(a(x) + b(x))`` with ``b`` 1e5 times larger: the add's A-to-output scale ratio (~1e-5) is
    below the 2**-14 QNNPACK's add accepts, while x86's add takes any ratio."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(8, 4)
        with torch.no_grad():
            self.b.weight.mul_(1e5)
            self.b.bias.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) + self.b(x))


def test_an_unpacked_op_is_checked_on_the_backends_engine_not_the_global_one(monkeypatch, capfd):
    """The check ran quantized::add under the caller's engine (x86), which accepted the region; the
    pinned qnnpack model then raised torch's INTERNAL ASSERT at every call. The reason QNNPACK
    printed on stderr (its scale-ratio limit) is the warning's, not a stray line on the terminal."""
    monkeypatch.setattr(torch.backends.quantized, "engine", "x86")
    torch.manual_seed(1)
    float_model = AddOfFarApartScales().eval()
    gen = torch.Generator().manual_seed(2)
    observed = qp.calibrate(qp.prepare_fx(float_model, None, (torch.randn(2, 16, generator=gen),),
                                          backend="qnnpack"),
                            [torch.randn(8, 16, generator=gen) for _ in range(4)])
    with pytest.warns(UserWarning, match=r"qplug: backend 'qnnpack', node 'add': kernel quantized::add "
                                         r"of plugin 'qnnpack' .* broke the kernel contract on the example "
                                         r"inputs \(the kernel library printed 'Error in QNNPACK: failed to "
                                         r"create add operator .* scale ratio must be in \[2\*\*-14, 2\*\*8\) "
                                         r"range' and it raised RuntimeError"):
        lowered = qp.convert_fx(observed)
    assert "QNNPACK" not in capfd.readouterr().err
    assert "add" not in qp.quantization_report(lowered).kernels
    x = torch.randn(4, 16, generator=gen)
    expected = qp.convert_to_reference_fx(observed)(x)
    assert (lowered(x) - expected).abs().max() <= one_step(expected) + 1e-6
    assert torch.backends.quantized.engine == "x86"


def test_one_whole_channel_wrong_breaks_the_contract():
    """One output channel of 256 wrong on every element (an int32 bias that overflowed) is under
    the 1% outlier allowance, but a broken kernel: the contract names the channel. Scattered
    outliers of the same count, and a channel wrong on one element of many, still pass."""
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 256, generator=gen)
    wrong = reference.clone()
    wrong[:, 0] = -7.28
    problem = kernel_contract.output_violation(wrong, reference, torch.float32, None)
    assert problem.startswith("channel 0 (dimension 1) is wrong as a whole: 2 of 2 of its outputs differ")
    scattered = reference.clone()
    scattered[0, 0] += 5.0
    scattered[1, 1] += 5.0
    assert kernel_contract.output_violation(scattered, reference, torch.float32, None) == ""
    conv = torch.randn(2, 256, 4, 4, generator=gen)
    wrong_conv = conv.clone()
    wrong_conv[:, 5, :, 1:] += 10.0  # 24 of the channel's 32 elements
    problem = kernel_contract.output_violation(wrong_conv, conv, torch.float32, None)
    assert problem.startswith("channel 5 (dimension 1) is wrong as a whole: 24 of 32")
    tokens = torch.randn(2, 8, 256, generator=gen)  # a linear on [batch, tokens, features]
    wrong_tokens = tokens.clone()
    wrong_tokens[..., 9] += 10.0
    assert kernel_contract.output_violation(wrong_tokens, tokens, torch.float32, None).startswith(
        "channel 9 (dimension 2)")
    assert kernel_contract.output_violation(wrong, reference, torch.float32, None, max_outlier_fraction=1.0) == ""


def test_a_region_with_one_wrong_channel_is_found_by_region_parity():
    """A delegated partition of several regions is checked region by region: a region whose
    channel is wrong as a whole is flagged though 99.6% of its elements are right."""
    from qplug_core.flows.region_parity import REGION_MIN_WITHIN, _compare

    want = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    got = want.clone()
    got[:, 0] = want[:, 0] ^ 128  # 128 steps off
    region = _compare("linear_quantize", got, want, steps=1)
    assert region.within > REGION_MIN_WITHIN and region.wrong_channel == (1, 0)
    assert _compare("linear_quantize", want, want, steps=1).wrong_channel is None
    assert region.problem(1).endswith("; its channel 0 (dimension 1) is wrong as a whole, beyond 2 steps on most "
                                      "elements")


def test_a_contract_and_weight_search_that_cannot_run_say_so_in_a_warning_and_the_report():
    """Example inputs the graph no longer takes (as after a plugin pass that changed it) used to
    skip the kernel contract and the 8-bit weight search silently: kernels went in unchecked."""
    from qplug_core.flows.tags import EXAMPLE_INPUTS
    from qplug_core.plugin_api import override_cpu_flags

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    with override_cpu_flags("fpu sse2 avx avx2 fma"):  # no VNNI: the 8-bit weight search runs here
        observed = qp.prepare_fx(model, None, (x,), backend="fbgemm")  # the defaults: searched
        qp.calibrate(observed, [(x,)])
        observed.meta[EXAMPLE_INPUTS] = (torch.randn(4, 5),)
        with pytest.warns(UserWarning, match=r"kernel contract not checked: the reference form did not run on "
                                             r"the example inputs \(RuntimeError: .*installed unchecked"):
            qmodel = qp.convert_fx(observed, backend="fbgemm")
    report = qp.quantization_report(qmodel)
    assert [note.split(":")[0] for note in report.notes] == ["8-bit weight search not run",
                                                             "kernel contract not checked"]
    assert "7-bit weights" in report.notes[0] and "note: kernel contract not checked" in str(report)


class RawUpsample(nn.Module):
    """torch's own int8 upsampling, called on its input as given (without lowering's
    ``dense_batch_stride``): wrong on a batch-1 map of transposed tokens."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(q, **self.kwargs)


class RawUpsampling(BackendPlugin):
    """fbgemm, with its upsampling as a plugin would write it: a kernel module calling torch's."""

    name = "rawup"
    description = "fbgemm with torch's int8 upsampling called as is"
    engine = "fbgemm"

    def kernels(self):
        table = super().kernels()
        table[torch.nn.functional.interpolate] = KernelSpec("test::raw_upsample",
                                                            build=lambda ctx: RawUpsample(ctx.kwargs))
        return table


class TokensUpsampled(nn.Module):
    """SegFormer's decoder: tokens through a linear, transposed and reshaped into a map, upsampled."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.fuse = nn.Linear(8, 8), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.proj(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(x.shape)
        return self.fuse(torch.nn.functional.interpolate(grid, size=(12, 12), mode="bilinear"))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_kernel_is_checked_on_the_view_the_model_passes_it(register_plugin, batch):
    """The check re-quantized each region's input afresh, contiguous; the model passes the
    upsampling a view of transposed tokens, which torch's kernel misreads at batch 1 (up to 255
    steps off): a plugin kernel calling it passed the check and made SegFormer's logits noise.
    The check now lays each input out as the example run did: at batch 1 it catches the kernel."""
    register_plugin(RawUpsampling(), "rawup")
    torch.manual_seed(0)
    data = [(torch.randn(batch, 8, 6, 6),) for _ in range(2)]
    observed = qp.calibrate(qp.prepare_fx(TokensUpsampled().eval(), None, data[0], backend="rawup"), data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = qp.convert_fx(observed)
    kernels = qp.quantization_report(lowered).kernels
    broke = [str(w.message) for w in caught if kernel_contract.CONTRACT_BROKEN in str(w.message)]
    if batch == 2:  # laid out as torch's kernel reads right: kept
        assert "test::raw_upsample" in kernels.values() and not broke
        return
    assert "test::raw_upsample" not in kernels.values()
    assert len(broke) == 1 and "kernel test::raw_upsample of plugin 'rawup' (qplug-rawup 0.1)" in broke[0]
    reference = qp.convert_to_reference_fx(observed)
    with torch.no_grad():
        expected = reference(*data[1])
        # rounding of the upsampling in float and the conv after it: 2 steps; the kernel's: over 100
        assert (lowered(*data[1]) - expected).abs().max() <= 4 * one_step(expected)


def test_auto_rejects_a_backend_whose_kernel_misreads_the_view_the_model_passes(register_plugin):
    """``backend="auto"`` finishes every candidate through the same check: the plugin's upsampling,
    wrong on the decoder's batch-1 view, makes its backend rejected, whatever its speed."""
    register_plugin(RawUpsampling(), "rawup")
    torch.manual_seed(0)
    data = [(torch.randn(1, 8, 6, 6),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = qp.quantize(TokensUpsampled().eval(), data[0], data, backend="auto", progress=False)
    trials = {t["backend"]: t for t in qp.quantization_report(quantized).auto}
    assert trials["rawup"]["status"] == "rejected" and kernel_contract.CONTRACT_BROKEN in trials["rawup"]["reason"]
    assert trials["fbgemm"]["status"] in ("chosen", "slower")


class RawUpsampleModule(nn.Module):
    """torch's own int8 upsampling of the float module (``nn.Upsample``), requantized to the
    module's output qparams: what a plugin quantizing upsampling with its own observer would run."""

    def __init__(self, ctx) -> None:
        super().__init__()
        self.upsample, self.qparams = ctx.module, ctx.output_qparams

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        y = self.upsample(q).dequantize()
        return torch.quantize_per_tensor(y, float(self.qparams.scale), int(self.qparams.zero_point), q.dtype)


class RawUpsamplingModules(BackendPlugin):
    """fbgemm, quantizing ``nn.Upsample`` with an observer of its own and the kernel above, so that
    eager mode swaps it and checks the kernel."""

    name = "rawupm"
    description = "fbgemm with nn.Upsample run by torch's int8 upsampling as is"
    engine = "fbgemm"

    def pattern_configs(self):
        shared = super().pattern_configs()
        upsample = BackendPatternConfig(nn.Upsample).set_observation_type(
            ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        for dtype_config in next(c for c in shared if c.pattern is nn.Linear).dtype_configs:
            upsample.add_dtype_config(dtype_config)
        return [*(c for c in shared if c.pattern is not nn.Upsample), upsample]

    def kernels(self):
        return {**super().kernels(), nn.Upsample: KernelSpec("test::raw_upsample_module", build=RawUpsampleModule)}


class TokensUpsampledByAModule(nn.Module):
    """:class:`TokensUpsampled` with its upsampling as a module, for eager mode."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = qp.eager.QuantStub(), qp.eager.DeQuantStub()
        self.proj, self.fuse = nn.Linear(8, 8), nn.Conv2d(8, 4, 1)
        self.resize = nn.Upsample(size=(12, 12), mode="bilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.proj(self.quant(x).flatten(2).transpose(1, 2)).transpose(1, 2).reshape(x.shape)
        return self.dequant(self.fuse(self.resize(grid)))


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_convert_checks_a_kernel_on_the_view_the_model_passes_it(register_plugin, batch):
    """Eager mode's twin of the test above. Eager convert took every upsampling module for one left
    running on the int8 tensors it gets, so one a plugin quantizes with its own kernel kept its
    observers and the converted model raised at every call; it is now swapped for the kernel, which
    the check runs on the view the model passes it: at batch 1 it catches the kernel."""
    register_plugin(RawUpsamplingModules(), "rawupm")
    torch.manual_seed(0)
    data = [torch.randn(batch, 8, 6, 6) for _ in range(2)]
    float_model = TokensUpsampledByAModule().eval()
    observed = {backend: qp.eager.prepare(float_model, backend=backend) for backend in ("rawupm", "reference")}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for model in observed.values():
            model(data[0])
        converted = {backend: qp.eager.convert(model) for backend, model in observed.items()}
    broke = [str(w.message) for w in caught if kernel_contract.CONTRACT_BROKEN in str(w.message)]
    kept = type(converted["rawupm"].resize) is RawUpsampleModule
    assert (kept, len(broke)) == ((False, 1) if batch == 1 else (True, 0))
    assert not broke or "module 'resize'" in broke[0]
    with torch.no_grad():
        expected = converted["reference"](data[1])
        # the reference backend does not round the upsampling's output, this plugin does (on its own
        # grid): 2-8 steps; the kernel's misreading: about 150
        assert (converted["rawupm"](data[1]) - expected).abs().max() <= 16 * one_step(expected)

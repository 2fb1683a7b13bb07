"""A vendor's first backend, written from the docs (qplug-acme's report): each mistake it made is
named with the plugin, its distribution and the pattern or kernel, and costs no more than it must."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import (
    BackendUnavailableError,
    KernelRuntimeError,
    PluginContractError,
    PluginHookError,
)
from qplug_core.registry import plugins
from qplug_core.registry.backends import environment_diagnostics
from qplug_core.testing.pattern_cases import cases_for

HEAD = '''
import torch
from torch import nn
from qplug_core.plugin_api import BackendPatternConfig, BackendPlugin, DTypeConfig, KernelSpec

INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8,
                   bias_dtype=torch.float)


class GoodLinear(nn.Module):
    """The tutorial's integer linear (per-tensor weights), relu applied when it is fused."""

    def __init__(self, ctx):
        super().__init__()
        x, w, o = ctx.input_qparams[0], ctx.weight_qparams, ctx.output_qparams
        weight = torch.round(ctx.root.weight.detach() / w.scale).clamp(-128, 127)
        self.register_buffer("w", weight.to(torch.int32).t().contiguous())
        self.register_buffer("b", torch.round(ctx.root.bias.detach() / (x.scale * w.scale)).to(torch.int32))
        self.xz, self.oz, self.m = int(x.zero_point), int(o.zero_point), float(x.scale * w.scale / o.scale)
        self.relu = bool(ctx.fused)

    def forward(self, x):
        acc = (x.to(torch.int32) - self.xz) @ self.w + self.b
        acc = acc.clamp(min=0) if self.relu else acc
        return torch.round(acc * self.m + self.oz).clamp(0, 255).to(torch.uint8)


class Vendor(BackendPlugin):
    name = "vendor"
    description = "linear (+ relu) on its own integer kernel"

    def pattern_configs(self):
        return [BackendPatternConfig(nn.Linear).add_dtype_config(INT8).set_root_module(nn.Linear)]

    def kernels(self):
        return {nn.Linear: KernelSpec("vendor::linear", build=GoodLinear)}

    def qconfig_options(self, mode):
        return {"per_channel": False}
'''


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def batches() -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen),) for _ in range(2)]


def install(fake_dist, body: str, dist: str = "qplug-vendor") -> None:
    fake_dist(dist, HEAD + body, module="qplug_vendor:plugin", entry_point="vendor")


def _with_kernel(fake_dist, kernel: str, build: str) -> torch.fx.GraphModule:
    """The model calibrated for a vendor whose linear kernel is ``build`` (its class in ``kernel``)."""
    install(fake_dist, kernel + f'''

class P(Vendor):
    def kernels(self):
        return {{nn.Linear: KernelSpec("vendor::linear", build={build})}}


plugin = P()
''')
    return qp.calibrate(qp.prepare_fx(model(), None, batches()[0], backend="vendor"), batches())


OUT_OF_SRAM = '''
class OutOfSram(nn.Module):
    def __init__(self, ctx):
        raise RuntimeError("ACME driver: out of SRAM")
'''
ZERO_POINT_OFF_BY_ONE = '''
class ZeroPointOffByOne(GoodLinear):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.oz += 1
'''


@pytest.mark.parametrize("kernel, build, node, says", [
    (OUT_OF_SRAM, "OutOfSram", "0", r"raised RuntimeError in build\(ctx\): ACME driver: out of SRAM; using the "
                                    r"reference form"),
    # one step off on every element (a runtime's zero point convention differing by one), within the
    # contract's steps everywhere: only its mean signed error shows it (it passed convert silently)
    (ZERO_POINT_OFF_BY_ONE, "ZeroPointOffByOne", "2", r"broke the kernel contract on the example inputs \(its outputs "
                                                      r"are off by \+(1.00|0.9\d) steps on average \(at most 0.25 either way"),
], ids=["build_raises", "one_step_off_on_every_output"])
def test_a_failing_kernel_leaves_its_regions_in_reference_form_naming_plugin_and_node(fake_dist, kernel, build,
                                                                                       node, says):
    observed = _with_kernel(fake_dist, kernel, build)
    with pytest.warns(UserWarning, match=rf"qplug: backend 'vendor', node '{node}': kernel vendor::linear of "
                                         rf"plugin 'vendor' \(qplug-vendor 0.1\) {says}"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert report.kernels == {} and re.search(says, report.reference[node])
    x = batches()[1][0]
    torch.testing.assert_close(lowered(x), qp.convert_to_reference_fx(observed)(x), rtol=0, atol=0)


FUSER_RAISES = '''
def fuse(is_qat, linear, relu):
    raise RuntimeError("ACME fuser: unsupported")


class P(Vendor):
    def pattern_configs(self):
        return [*super().pattern_configs(),
                BackendPatternConfig((nn.Linear, nn.ReLU)).add_dtype_config(INT8).set_fuser_method(fuse)]


plugin = P()
'''


def test_fuser_method_that_raises_names_plugin_pattern_and_fuser(fake_dist):
    install(fake_dist, FUSER_RAISES)
    with pytest.raises(PluginHookError, match=r"plugin 'vendor' \(qplug-vendor 0.1\): fuser method "
                                              r"qplug_vendor.fuse of pattern ReLU <- Linear raised "
                                              r"RuntimeError: ACME fuser: unsupported") as raised:
        qp.quantize(model(), batches()[0], batches(), backend="vendor")
    assert (raised.value.plugin, raised.value.dist) == ("vendor", "qplug-vendor")
    assert isinstance(raised.value.__cause__, RuntimeError)


@pytest.mark.parametrize("key, shown, hint", [
    ("(nn.Linear, nn.ReLU)", r"\(Linear, ReLU\)", r"; did you mean \(ReLU, Linear\)\?"),  # simple format
    ("nn.Conv1d", "Conv1d", ""),  # a pattern no config declares
])
def test_kernel_keyed_by_no_declared_pattern_is_named_at_assembly_and_by_doctor(fake_dist, key, shown, hint):
    install(fake_dist, f'''
class P(Vendor):
    def pattern_configs(self):
        return [*super().pattern_configs(), BackendPatternConfig((nn.Linear, nn.ReLU)).add_dtype_config(INT8)]

    def kernels(self):
        return {{**super().kernels(), {key}: KernelSpec("vendor::other", build=GoodLinear)}}


plugin = P()
''')
    message = (rf"plugin 'vendor' \(qplug-vendor 0.1\): kernel vendor::other is keyed by {shown}, which "
               r"matches no pattern config of backend 'vendor', so it is never used; kernels are keyed "
               rf"by the complex-format pattern \(last op first\){hint}")
    with pytest.warns(plugins.QplugPluginWarning, match=message):
        info = next(i for i in qp.list_backends() if i.name == "vendor")
    assert info.status == "ok"  # the plugin's other kernels still work
    doctor = [d for scope, d in environment_diagnostics() if scope == "backend vendor"]
    assert any(d.level == "warning" and "vendor::other" in d.message for d in doctor)


def test_pattern_configs_returning_one_config_is_a_contract_error(fake_dist):
    install(fake_dist, '''
class P(Vendor):
    def pattern_configs(self):
        return BackendPatternConfig(nn.Linear).add_dtype_config(INT8)


plugin = P()
''')
    with pytest.warns(plugins.QplugPluginWarning):
        info = next(i for i in qp.list_backends() if i.name == "vendor")
    assert info.status == "broken"
    assert "hook qplug_backend_pattern_configs must return list[BackendPatternConfig], got " \
           "BackendPatternConfig" in info.reason
    error = next(r for r in plugins.plugin_records() if r.name == "vendor").error
    assert isinstance(error, PluginContractError) and error.hook == "qplug_backend_pattern_configs"


@pytest.mark.parametrize("gemm, says", [
    ("raise RuntimeError('the probe needs the device')", "the probe failed (RuntimeError: the probe needs the device)"),
    ("return torch.zeros(1)", "the probe failed (RuntimeError: shape '[1, 4]' is invalid"),
])
def test_an_int8_gemm_probe_that_raises_or_returns_garbage_is_a_doctor_warning(fake_dist, gemm, says):
    install(fake_dist, f'''
from qplug_core.plugin_api import Int8Arithmetic


class P(Vendor):
    int8_arithmetic = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI

    def int8_gemm(self):
        def gemm(codes, weights):
            {gemm}
        return gemm


plugin = P()
''')
    doctor = [d for scope, d in environment_diagnostics() if scope == "backend vendor"]
    broken = [d for d in doctor if "int8_gemm() probe is broken" in d.message]
    assert len(broken) == 1 and broken[0].level == "warning" and says in broken[0].message
    assert "[M, N]" in broken[0].hint


def test_entry_point_naming_the_class_is_refused_plainly_and_stops_no_other_backend(fake_dist, monkeypatch):
    fake_dist("qplug-vendor", HEAD, module="qplug_vendor:Vendor", entry_point="vendor")
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-vendor,fbgemm")
    plugins.reset()
    with pytest.warns(plugins.QplugPluginWarning, match=r"entry point names the class Vendor; name an "
                                                        r"instance: `plugin = Vendor\(\)`"):
        rows = {info.name: info.status for info in qp.list_backends()}
    assert rows == {"reference": "ok", "fbgemm": "ok"}
    report = qp.quantization_report(qp.quantize(model(), batches()[0], batches(), backend="fbgemm"))
    assert set(report.kernels) == {"0", "2"}  # both layers on fbgemm's kernels


RAISES_FOR_EVERY_BACKEND = """
from qplug_core.plugin_api import hookimpl

asked = []


@hookimpl
def qplug_fuser_methods(backend):
    asked.append(backend)
    raise RuntimeError("vendor SDK not initialised")
"""


def test_a_plugin_failing_in_a_hook_is_not_asked_again(fake_dist, monkeypatch):
    fake_dist("qplug-meddler", RAISES_FOR_EVERY_BACKEND)
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-meddler,fbgemm")
    plugins.reset()
    with pytest.warns(plugins.QplugPluginWarning, match="vendor SDK not initialised"):
        rows = qp.list_backends()
    import qplug_meddler

    assert len(qplug_meddler.asked) == 1  # not once per backend assembled
    assert [row.status for row in rows] == ["ok", "ok"]  # another plugin's failure breaks neither
    report = qp.quantization_report(qp.quantize(model(), batches()[0], batches(), backend="fbgemm"))
    assert set(report.kernels) == {"0", "2"}  # both layers on fbgemm's kernels


def test_a_backend_whose_kernel_table_was_rejected_is_refused_with_its_problem(fake_dist):
    install(fake_dist, '''
class P(Vendor):
    def kernels(self):
        return list(super().kernels().values())


plugin = P()
''')
    with pytest.warns(plugins.QplugPluginWarning):
        assert next(i for i in qp.list_backends() if i.name == "vendor").status == "broken"
    with pytest.raises(BackendUnavailableError, match=r"backend 'vendor' is broken: plugin 'vendor' "
                                                      r"\(qplug-vendor 0.1\): hook qplug_int8_kernels must "
                                                      r"return dict\[Pattern, KernelSpec\], got "
                                                      r"list\[KernelSpec\]") as raised:
        qp.quantize(model(), batches()[0], batches(), backend="vendor")
    assert isinstance(raised.value.__cause__, PluginContractError)


def test_a_kernel_backend_lowering_nothing_says_so_and_counts_its_reference_form_layers(fake_dist):
    install(fake_dist, '''
class P(Vendor):
    def kernels(self):
        return {}


plugin = P()
''')
    with pytest.warns(UserWarning, match=r"backend 'vendor' has no int8 kernel for these layers, which "
                                         r"run in reference form .*'0' .*'2'"):
        lowered = qp.quantize(model(), batches()[0], batches(), backend="vendor")
    report = qp.quantization_report(lowered)
    assert set(report.reference) == {"0", "2"} and report.kernels == {}
    assert "reference form (no kernel): 2" in str(report)


def test_a_kernel_raising_after_convert_names_its_layer_plugin_and_kernel(fake_dist):
    install(fake_dist, '''
class SmallBuffer(GoodLinear):
    def forward(self, x):
        if x.shape[0] > 16:
            raise RuntimeError("ACME driver: batch exceeds on-chip buffer")
        return super().forward(x)


class P(Vendor):
    def kernels(self):
        return {nn.Linear: KernelSpec("vendor::linear", build=SmallBuffer)}


plugin = P()
''')
    qmodel = qp.quantize(model(), batches()[0], batches(), backend="vendor")
    qmodel(torch.randn(16, 8))  # within the runtime's buffer
    with pytest.raises(KernelRuntimeError, match=r"backend 'vendor': kernel vendor::linear of plugin 'vendor' "
                                                 r"\(qplug-vendor 0.1\) raised RuntimeError in layer '0': "
                                                 r"ACME driver: batch exceeds on-chip buffer") as raised:
        qmodel(torch.randn(32, 8))
    error = raised.value
    assert (error.plugin, error.dist, error.kernel, error.layer) == ("vendor", "qplug-vendor", "vendor::linear", "0")
    assert isinstance(error.__cause__, RuntimeError) and "on-chip buffer" in str(error.__cause__)
    assert isinstance(error, RuntimeError)  # code catching torch's kernel errors still catches it


def test_dtype_config_set_claims_only_the_families_a_vendor_sets(fake_dist):
    install(fake_dist, '''
from qplug_core.plugin_api import DTypeConfigSet


class P(Vendor):
    dtype_configs = DTypeConfigSet(weighted_op=(INT8,), default_op=(INT8,))

    def pattern_configs(self):
        return BackendPlugin.pattern_configs(self)


plugin = P()
''')
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)).eval()
    ids = torch.randint(0, 10, (4, 3))
    claimed = {cfg.pattern for cfg in qp.get_backend("vendor").config.configs if cfg.dtype_configs}
    assert nn.Linear in claimed and not claimed & {nn.Embedding, nn.LSTM, nn.LayerNorm, nn.GRUCell}
    with pytest.warns(UserWarning, match=r"weights stay float: '0' \(the backend has no int8 kernel for Embedding\)"):
        report = qp.quantization_report(qp.quantize(net, (ids,), [(ids,)], backend="vendor"))
    assert set(report.quantized) == {"1"} and report.kernels == {"1": "vendor::linear"}


def test_pattern_suite_skips_what_a_backend_has_no_default_or_dtype_config_for(fake_dist):
    install(fake_dist, '''
from qplug_core.plugin_api import DTypeConfigSet, default_dynamic_int8_dtype_config


class P(Vendor):
    dtype_configs = DTypeConfigSet(weighted_op=(INT8,), default_op=(INT8,),
                                   dynamic=(default_dynamic_int8_dtype_config,))

    def pattern_configs(self):  # three of the shared set's patterns: the cases build in no time
        return [config for config in BackendPlugin.pattern_configs(self)
                if config.pattern in (nn.Linear, nn.LSTM, nn.Embedding)]

    def qconfig_options(self, mode):
        return None if mode == "dynamic" else {"per_channel": False}


plugin = P()
''')
    cases = {case.id: case for case in cases_for("vendor")}
    assert cases["LSTM"].make_model is None
    assert cases["LSTM"].skip_reason == ("backend 'vendor' has no default 'dynamic' qconfig mapping to run this "
                                         "dynamic case with")
    assert cases["Embedding"].skip_reason == ("backend 'vendor' gives this pattern no dtype config: it claims "
                                              "no int8 form of it")
    assert cases["Linear"].skip_reason is None and cases["Linear"].make_model is not None


def test_an_explicit_mapping_equal_to_the_default_says_the_bias_correction_is_off(fake_dist):
    install(fake_dist, "plugin = Vendor()\n")
    default = qp.quantization_report(qp.quantize(model(), batches()[0], batches(), backend="vendor"))
    given = qp.quantization_report(qp.quantize(model(), batches()[0], batches(), backend="vendor",
                                               qconfig_mapping=qp.get_default_qconfig_mapping("vendor")))
    assert default.recipe.startswith("auto: bias correction")
    assert given.recipe.startswith("none: a qconfig_mapping was given") and "recipe: none" in str(given)


def test_doctor_names_a_default_qconfig_that_contradicts_the_backends_own_dtype_configs(fake_dist):
    from qplug_core.flows.default_fit import default_fit_diagnostics

    install(fake_dist, '''
from qplug_core.plugin_api import DTypeWithConstraints

SEVEN_BITS = DTypeConfig(input_dtype=DTypeWithConstraints(torch.quint8, quant_min_lower_bound=0,
                                                          quant_max_upper_bound=127),
                         output_dtype=torch.quint8, weight_dtype=torch.qint8, bias_dtype=torch.float)


class P(Vendor):
    def pattern_configs(self):
        return [BackendPatternConfig(nn.Linear).add_dtype_config(SEVEN_BITS).set_root_module(nn.Linear)]


plugin = P()
''')
    assert next(i for i in qp.list_backends() if i.name == "vendor").status == "ok"
    findings = [(scope, d.level, d.message) for scope, d in default_fit_diagnostics()]  # qplug doctor's
    assert [(scope, level) for scope, level, _ in findings] == [("backend vendor", "error")] * 2  # static, qat
    assert findings[0][2] == (
        "its default 'static' qconfig contradicts its own dtype configs of 1 weighted pattern(s) (Linear): "
        "activation: quant range (0, 255) must fall within the backend's (0, 127): give the observer "
        "quant_min=0, quant_max=127; qp.quantize with the "
        "defaults leaves them float: set reduce_range=True (activations in [0, 127]) in qconfig_options('static')")

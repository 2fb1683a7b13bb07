"""Defects an engineer migrating a torch.ao code base found (2026-12-06): each test is the migrated
call, with torch.ao's numbers or the error a user relies on."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import BackendNotFoundError, ConfigError, ConfigValidationError, ModelStateError
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class ShapeBranch(nn.Module):
    """Python control flow on a shape: symbolic tracing refuses it, capture='auto' exports."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)
        self.drop, self.fc = nn.Dropout(0.5), nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        if x.shape[-1] > 100:
            x = x * 2
        return self.fc(self.drop(torch.flatten(x, 1)))


@pytest.mark.parametrize("capture", ["export", "auto"])
def test_prepare_qat_on_a_batch_1_example_leaves_the_float_model_alone(capture):
    """Checking the batch-widened export ran the training-mode model on the example: its BatchNorm
    statistics moved, and the prepared copy started with two BN updates already made."""
    torch.manual_seed(0)
    model = ShapeBranch().train()
    before = copy.deepcopy(model.state_dict())
    prepared = qp.prepare_qat_fx(model, None, (torch.randn(1, 1, 8, 8),), backend="fbgemm", capture=capture)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in before.items())
    bn = next(m for m in prepared.modules() if isinstance(m, nn.BatchNorm2d))
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, before["bn.running_mean"])
    assert prepared(torch.randn(4, 1, 8, 8)).shape == (4, 10)  # the batch stays dynamic


def _ao():
    import torch.ao.nn.quantized as ao_nnq
    import torch.ao.quantization as tq
    return tq, ao_nnq


class EagerNet(nn.Module):
    """torch.ao's eager tutorial shape: stubs, a conv-relu to fuse, a residual add by FloatFunctional."""

    def __init__(self, quant: type, dequant: type, functional: type) -> None:
        super().__init__()
        self.quant, self.dequant, self.skip = quant(), dequant(), functional()
        self.conv, self.relu = nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()
        self.fc = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.skip.add(self.relu(self.conv(x)), x)
        return self.dequant(self.fc(torch.flatten(x, 1)))


def _eager_int8(model: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    observed = qp.eager.prepare(model, backend="fbgemm")
    with torch.no_grad():
        for x in batches:
            observed(x)
    return qp.eager.convert(observed)


def test_torch_aos_stubs_functionals_and_fused_modules_run_as_qplugs_own():
    """torch.ao's QuantStub/DeQuantStub/FloatFunctional met int8 tensors as float modules (a raw
    "Could not run 'quantized::linear'" at the first call), and a conv fused by torch.ao's
    fuse_modules stayed float without a word: the model answers as the same one built from qplug's."""
    tq, ao_nnq = _ao()
    torch.manual_seed(0)
    ours = EagerNet(qp.eager.QuantStub, qp.eager.DeQuantStub, qp.eager.FloatFunctional).eval()
    theirs = EagerNet(tq.QuantStub, tq.DeQuantStub, ao_nnq.FloatFunctional).eval()
    theirs.load_state_dict(ours.state_dict())
    batches = [torch.randn(4, 3, 8, 8) for _ in range(4)]
    expected = _eager_int8(qp.eager.fuse_modules(ours, [["conv", "relu"]]), batches)
    got = _eager_int8(tq.fuse_modules(theirs, [["conv", "relu"]]), batches)
    assert type(got.conv) is type(expected.conv) and type(got.conv).__module__.startswith("qplug")
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(got(x), expected(x), rtol=0, atol=0)
    assert type(theirs.quant) is tq.QuantStub  # the user's model is left as it was


def test_torch_aos_int8_modules_and_qconfig_attributes_are_refused_by_name():
    """model.qconfig = torch.ao's get_default_qconfig('fbgemm') gave a float model with torch.ao's
    observers attached, silently; its QAT twin an AttributeError from inside prepare_qat."""
    tq, ao_nnq = _ao()
    model = EagerNet(qp.eager.QuantStub, qp.eager.DeQuantStub, qp.eager.FloatFunctional).eval()
    model.qconfig = tq.get_default_qconfig("fbgemm")
    with pytest.raises(ConfigValidationError, match=r"model.qconfig must be qplug's QConfig.*torch.ao's"):
        qp.eager.prepare(model, backend="fbgemm")
    model.train().qconfig = tq.get_default_qat_qconfig("fbgemm")
    with pytest.raises(ConfigValidationError, match=r"model.qconfig must be qplug's QConfig"):
        qp.eager.prepare_qat(model, backend="fbgemm")
    del model.qconfig
    model.fc = ao_nnq.Linear(3 * 8 * 8, 4)
    with pytest.raises(ConfigValidationError, match=r"module 'fc' is torch.ao's .*Linear: qplug's eager "
                                                       r"prepare takes float modules"):
        qp.eager.prepare(model.eval(), backend="fbgemm")


class StubbedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = qp.eager.QuantStub(), qp.eager.DeQuantStub()
        self.lstm, self.fc = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.lstm(self.quant(x))[0]))


def test_a_float_layer_reached_by_int8_tensors_names_itself():
    """A static nn.LSTM between the stubs (no static int8 kernel) stayed float and the first call
    raised torch's "Could not run 'aten::zero_' with arguments from the 'QuantizedCPU' backend"."""
    torch.manual_seed(0)
    int8 = _eager_int8(StubbedLSTM().eval(), [torch.randn(4, 6, 8) for _ in range(3)])
    with pytest.raises(ModelStateError, match=r"module 'lstm' \(LSTM\) stayed float after qp.eager.convert "
                                                 r".*put a DeQuantStub before it.*qp.quantize_dynamic"):
        int8(torch.randn(2, 6, 8))


def test_torch_aos_x86_engine_name_points_at_the_backend_running_its_kernels():
    """torch.ao's tutorials spell get_default_qconfig_mapping("x86"): the error said to install a
    plugin that provides it, which does not exist."""
    with pytest.raises(BackendNotFoundError, match=r"'x86' is a torch quantized engine .*not a qplug backend: "
                                                   r"backend 'fbgemm' runs its kernels"):
        qp.get_default_qconfig_mapping("x86")


def test_a_backend_config_naming_torch_aos_fused_classes_says_they_have_no_kernels():
    """torch.ao's BackendConfig tutorial fuses into torch.ao.nn.intrinsic.LinearReLU: migrated with
    with_config, the fused layer ran in reference form (float ops) without a word, and to_dict
    said to "use the torch or qplug object" of what is a torch object."""
    import torch.ao.nn.intrinsic as ao_nni
    import torch.ao.nn.qat as ao_nnqat

    dtypes = qp.DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8,
                            bias_dtype=torch.float)
    config = (qp.BackendConfig("migrated")
              .set_backend_pattern_config(qp.BackendPatternConfig((nn.Linear, nn.ReLU)).add_dtype_config(dtypes)
                                          .set_fuser_method(lambda is_qat, linear, relu: ao_nni.LinearReLU(linear, relu))
                                          .set_fused_module(ao_nni.LinearReLU))
              .set_backend_pattern_config(qp.BackendPatternConfig(ao_nni.LinearReLU).add_dtype_config(dtypes)
                                          .set_root_module(nn.Linear)))
    with pytest.warns(UserWarning, match=r"BackendConfig 'migrated' names torch.ao's LinearReLU: backend "
                                         r"'fbgemm' keys its kernels by qplug's classes"):
        qp.get_backend("fbgemm").with_config(config)
    # refused where it is set (it was taken, and only to_dict said so)
    with pytest.raises(ConfigError, match=r"qat_module is torch.ao's torch.ao.nn.qat.modules.linear.Linear.*"
                                          r"use qplug_core.nn.qat.Linear"):
        qp.BackendPatternConfig(nn.Linear).add_dtype_config(dtypes).set_qat_module(ao_nnqat.Linear)


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if x.sum() > 0 else self.inner(-x)  # neither capture can branch on data


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.branching, self.fc2 = nn.Linear(16, 8), Branching(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.branching(torch.relu(self.fc1(x)))))


def test_a_failed_export_attempt_prints_nothing(capfd):
    """capture='auto' tried torch.export first and torch printed its partial graphs on stderr
    (dozens of lines) before qplug fell back: the report names what stayed float instead."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    qmodel = qp.quantize(DataDependent().eval(), (x,), [(x,)], backend="fbgemm", capture="auto")
    assert "branching" in {entry.node for entry in qp.quantization_report(qmodel).skipped}
    err = capfd.readouterr().err
    assert "def forward" not in err and "Unable to find user code" not in err, err


#: how a model may write the attention scores ``q @ k``, each recorded otherwise by symbolic capture
SPELLINGS = {"torch.matmul": lambda q, k: torch.matmul(q, k), "@": lambda q, k: q @ k,
             ".matmul": lambda q, k: q.matmul(k), "torch.bmm": lambda q, k: torch.bmm(q, k),
             ".bmm": lambda q, k: q.bmm(k), "torch.mm": lambda q, k: torch.mm(q, k), ".mm": lambda q, k: q.mm(k)}


class Scores(nn.Module):
    """Attention scores between two int8 linears, written with one of :data:`SPELLINGS`."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.q, self.k, self.out, self.spelling = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(8, 4), spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(SPELLINGS[self.spelling](self.q(x), self.k(x).transpose(-1, -2)))


_SCORES_DATA = [(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
_SCORES_DATA_2D = [(x[0],) for (x,) in _SCORES_DATA]  # for torch.mm: one (8, 16) matrix


@functools.lru_cache(maxsize=None)
def _int8_scores(spelling: str, backend: str, rank: int = 3):
    """(float model, int8 model, its report) of :class:`Scores` written ``spelling``, on ``rank``-D inputs."""
    torch.manual_seed(1)
    model = Scores(spelling).eval()
    data = _SCORES_DATA if rank == 3 else _SCORES_DATA_2D
    int8 = qp.quantize(model, data[0], data, backend=backend, progress=False)
    return model, int8, qp.quantization_report(int8)


@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
@pytest.mark.parametrize("spelling, pattern", [("@", "operator.matmul"), (".matmul", ".matmul()"),
                                               ("torch.bmm", "torch.bmm"), (".bmm", ".bmm()")])
def test_each_spelling_of_a_matmul_is_int8_like_torch_matmul(spelling, pattern, backend):
    """Under the default (symbolic) capture ``q @ k`` (operator.matmul), ``q.matmul(k)``,
    ``torch.bmm`` and ``q.bmm(k)`` had no pattern ("no quantization pattern of the backend matches
    this op") and stayed float while ``torch.matmul`` was int8 (torch.export gave ``aten.matmul`` for
    the first two, int8, and an unraised ``aten.bmm``, float): every spelling is int8 now, with the
    same numbers."""
    _, int8, report = _int8_scores(spelling, backend)
    _, expected_int8, expected = _int8_scores("torch.matmul", backend)
    assert not report.skipped
    assert pattern in report.quantized.values() and len(report.quantized) == len(expected.quantized)
    assert sorted(report.kernels.values()) == sorted(expected.kernels.values())
    with torch.no_grad():
        assert torch.equal(int8(*_SCORES_DATA[1]), expected_int8(*_SCORES_DATA[1]))


@pytest.mark.parametrize("spelling", ["torch.bmm", ".bmm"])
def test_an_int8_bmm_refuses_a_4d_input_as_torch_bmm_does(spelling):
    """quantized.matmul takes any rank; the int8 bmm raises where the float model's torch.bmm does."""
    model, int8, _ = _int8_scores(spelling, "fbgemm")
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="3D"):
        model(x)
    with pytest.raises(RuntimeError, match="int8 bmm takes two 3-D tensors"):
        int8(x)


@pytest.mark.parametrize("spelling, pattern", [("torch.mm", "torch.mm"), (".mm", ".mm()")])
def test_an_mm_between_activations_is_int8_like_torch_matmul(spelling, pattern):
    """``torch.mm(q, k)`` / ``q.mm(k)`` between two activations had no pattern (torch.ao has none
    either) and stayed float (torch.export's ``aten.mm`` was not raised: the backends' pattern suites
    check the export level): int8 now, with torch.matmul's numbers; the int8 mm refuses what
    torch.mm refuses."""
    _, int8, report = _int8_scores(spelling, "fbgemm", rank=2)
    _, expected_int8, expected = _int8_scores("torch.matmul", "fbgemm", rank=2)
    assert not report.skipped
    assert pattern in report.quantized.values()
    assert sorted(report.kernels.values()) == sorted(expected.kernels.values())
    x = _SCORES_DATA_2D[1]
    with torch.no_grad():
        assert torch.equal(int8(*x), expected_int8(*x))
    with pytest.raises(RuntimeError, match="int8 mm takes two 2-D tensors"):
        int8(_SCORES_DATA[1][0])


class Propagate(nn.Module):
    """A GNN layer: ``torch.mm(adjacency, x)`` with a sparse adjacency between two int8 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.mm(adjacency, self.l1(x)))


def test_an_mm_with_a_sparse_operand_stays_float_saying_why():
    """With the mm pattern the sparse adjacency got an observer, which cannot take its min/max
    (calibration failed with torch's "aminmax ... SparseCPU"): the op stays float, with the reason."""
    g = torch.Generator().manual_seed(0)
    adjacency = torch.sparse_coo_tensor(torch.randint(0, 10, (2, 30), generator=g), torch.rand(30, generator=g),
                                        (10, 10), check_invariants=True)
    model, x = Propagate().eval(), torch.randn(10, 8, generator=g)
    int8 = qp.quantize(model, (adjacency, x), [(adjacency, x)], backend="fbgemm", capture="symbolic")
    reasons = {entry.node: entry.reason for entry in qp.quantization_report(int8).skipped}
    assert reasons["mm"] == "'adjacency' is a sparse_coo tensor; int8 kernels take strided (dense) tensors only"
    torch.testing.assert_close(int8(adjacency, x), model(adjacency, x), atol=0.05, rtol=0)


def _depthwise_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                         nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


_DEPTHWISE_DATA = [(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)),) for i in range(2)]


def test_an_explicit_8_bit_observer_made_7_bit_for_a_depthwise_conv_is_reported():
    """fbgemm gives a depthwise conv's input 7 bits whatever the qconfig says; a user who asked 8
    bits (torch.ao honours it) was not told: one warning and a report note name the layer and why."""
    qconfig = qp.QConfig(activation=MinMaxObserver.with_args(reduce_range=False),
                         weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                   qscheme=torch.per_channel_symmetric))
    with pytest.warns(UserWarning, match=r"qplug: fbgemm gave the input of 1 layer\(s\) 7 bits \(codes 0\.\.127\) "
                                         r"where your qconfig asks 8 \(0\.\.255\): '2'\. Why \(fbgemm's prepare pass "
                                         r"limit_depthwise_input_range\): fbgemm's depthwise kernels sum u8 x s8 pairs "
                                         r"in int16, saturating") as caught:
        observed = qp.prepare_fx(_depthwise_net(), qp.QConfigMapping().set_global(qconfig), _DEPTHWISE_DATA[0],
                                 backend="fbgemm")
    assert sum("gave the input of" in str(w.message) for w in caught) == 1
    int8 = qp.convert_fx(qp.calibrate(observed, _DEPTHWISE_DATA))
    assert any("7 bits (codes 0..127) where your qconfig asks 8" in note for note in qp.quantization_report(int8).notes)

    ao = pytest.importorskip("torch.ao.quantization")
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    ao_qconfig = ao.QConfig(activation=ao.MinMaxObserver.with_args(reduce_range=False),
                            weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                         qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation
        ao_observed = quantize_fx.prepare_fx(_depthwise_net(), ao.QConfigMapping().set_global(ao_qconfig),
                                             _DEPTHWISE_DATA[0])
        for batch in _DEPTHWISE_DATA:
            ao_observed(*batch)
        ao_int8 = quantize_fx.convert_fx(ao_observed)
    # the conv feeding the depthwise one: torch.ao's 8-bit grid, qplug's 7-bit one (what the warning says)
    assert int8.get_submodule("0").scale / ao_int8.get_submodule("0").scale == pytest.approx(255 / 127)


@pytest.mark.parametrize("mapping", [None, "default written out"])
def test_the_backends_own_7_bit_depthwise_inputs_are_not_reported(mapping, recwarn):
    default = qp.get_default_qconfig_mapping("fbgemm") if mapping else None
    qp.prepare_fx(_depthwise_net(), default, _DEPTHWISE_DATA[0], backend="fbgemm")
    assert not [w for w in recwarn if "gave the input of" in str(w.message)]

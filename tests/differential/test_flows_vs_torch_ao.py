"""qplug's graph-mode flows against torch.ao's prepare_fx / convert_to_reference_fx on the same models.

Both sides use torch.ao's default qconfig semantics (HistogramObserver activations, reduce_range, and
per-channel symmetric int8 weights) as one global qconfig; qplug runs with
``keep_isolated_ops_float=False`` so that it quantizes every op torch.ao quantizes. Checked:

* fusion: the same modules are called, with the same types (torch.ao.nn.intrinsic.X <-> qplug X),
  and the folded weights are equal;
* observers: the same values are observed, in the same order, with the same sharing (max-pool,
  flatten, ReLU6... share their input's observer *module* on both sides), and calibration gives
  identical qparams;
* convert_to_reference_fx: outputs within one quantization step on >= 99% of elements.

Known, asserted difference (a qplug bug, see ``test_reduce_range_reference_outputs``): with
reduce_range the observers pick qparams for [0, 127], and qplug's reference ``Quantize`` clamps to
[0, 127] while torch.ao's reference (``torch.quantize_per_tensor``) and the fbgemm kernels clamp to the
dtype's [0, 255]. The end-to-end output check therefore uses the same qconfig with full-range
activations; the per-quantize-point check runs with reduce_range too, on values inside the range.

MobileNetV2 with random weights amplifies any 1-step rounding difference through its 17 blocks
(end-to-end it is chaotic for every tool), so its output check is made per quantize point: each
quantize op of qplug's reference model is fed the float value torch.ao's reference model quantizes
at the same place.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx, nn

tq = pytest.importorskip("torch.ao.quantization")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")

import qplug_core as qp  # noqa: E402
from qplug_core.config import QConfig, QConfigMapping  # noqa: E402
from qplug_core.flows.tags import OBSERVER  # noqa: E402
from qplug_core.kernels.reference import Quantize, ReferenceWeighted  # noqa: E402
from qplug_core.observers import HistogramObserver, PerChannelMinMaxObserver  # noqa: E402
from qplug_core.zoo import calibrate_batchnorm, get_model  # noqa: E402
from qplug_core.zoo.digits import digits_cnn  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]


class SmallResNet(nn.Module):
    """conv-bn-relu, conv-bn + identity add -> relu, max-pool, flatten, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


def _small_resnet() -> nn.Module:
    torch.manual_seed(0)
    return SmallResNet().eval()


#: name -> (builder, input channels, pixels); weighted modules re-estimate BN stats at that size
def _without_dropout(model: nn.Module) -> nn.Module:
    """The model with its (eval-mode) Dropout modules taken out, for both tools.

    Deliberate difference (issue 19.15): qplug removes eval-mode Dropout, which computes nothing,
    while torch.ao observes its output; without the module both tools see the same graph.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout):
            model.set_submodule(name, _Pass())  # traced through by both tools: no node
    return model


class _Pass(nn.Module):
    """A plain (non-torch.nn) module returning its input: symbolic tracing inlines it."""

    def forward(self, x):
        return x


MODELS = {
    "small_resnet": (_small_resnet, 3, 16),
    "digits_cnn": (lambda: digits_cnn().eval(), 1, 8),
    "resnet18": (lambda: get_model("resnet18", seed=0), 3, 64),
    "mobilenet_v2": (lambda: _without_dropout(get_model("mobilenet_v2", seed=0)), 3, 64),
}
CHAOTIC = {"mobilenet_v2"}
#: models whose ReLU6 qplug folds into the producing conv's output range (issue 19, item 18), so
#: the conv's output is observed after the clamp; torch.ao observes the conv and the ReLU6 apart.
#: A deliberate difference (docs/migrating.md): observer layout and quantize points differ there.
CLAMPS_FOLDED = {"mobilenet_v2"}


def _ours_mapping(reduce_range: bool) -> QConfigMapping:
    return QConfigMapping().set_global(QConfig(
        activation=HistogramObserver.with_args(reduce_range=reduce_range),
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)))


def _ao_mapping(reduce_range: bool):
    if reduce_range:
        qconfig = tq.get_default_qconfig("fbgemm")  # torch.ao's default, as is
        assert qconfig.activation().reduce_range
    else:
        qconfig = tq.QConfig(activation=tq.HistogramObserver.with_args(reduce_range=False),
                             weight=tq.default_per_channel_weight_observer)
    return tq.QConfigMapping().set_global(qconfig)


class Pair:
    """One model prepared and calibrated by both tools."""

    def __init__(self, name: str, reduce_range: bool) -> None:
        build, channels, px = MODELS[name]
        self.name = name
        self.inputs = lambda seed, batch=2: (
            torch.randn(batch, channels, px, px, generator=torch.Generator().manual_seed(seed)),)
        self.model = build()
        calibrate_batchnorm(self.model, [self.inputs(100 + s, 8) for s in range(2)])
        example = self.inputs(0)
        self.ours = qp.prepare_fx(self.model, _ours_mapping(reduce_range), example, backend="reference",
                                  keep_isolated_ops_float=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.theirs = quantize_fx.prepare_fx(copy.deepcopy(self.model), _ao_mapping(reduce_range),
                                                 example)
        with torch.no_grad():
            for seed in (1, 2):
                self.ours(*self.inputs(seed))
                self.theirs(*self.inputs(seed))
        self.ours_reference = qp.convert_to_reference_fx(self.ours)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.theirs_reference = quantize_fx.convert_to_reference_fx(copy.deepcopy(self.theirs))


_pairs: dict[tuple[str, bool], Pair] = {}


def _pair(name: str, reduce_range: bool = True) -> Pair:
    if (name, reduce_range) not in _pairs:
        _pairs[(name, reduce_range)] = Pair(name, reduce_range)
    return _pairs[(name, reduce_range)]


@pytest.fixture(scope="module", autouse=True)
def _drop_pairs():
    yield
    _pairs.clear()


def _is_ao_observer(module: nn.Module) -> bool:
    return isinstance(module, (tq.ObserverBase, tq.FakeQuantizeBase))


def _called_modules(gm: fx.GraphModule, is_observer) -> dict[str, str]:
    return {n.target: type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes
            if n.op == "call_module" and not is_observer(gm.get_submodule(n.target))}


def _ours_is_observer(module: nn.Module) -> bool:
    from qplug_core.flows.prepare import is_observer_module
    return is_observer_module(module)


@pytest.mark.parametrize("name", list(MODELS))
def test_same_fused_modules(name):
    pair = _pair(name)
    ours = _called_modules(pair.ours, _ours_is_observer)
    theirs = _called_modules(pair.theirs, _is_ao_observer)
    assert ours == theirs
    fused = {t for t in ours.values() if t.endswith(("ReLU2d", "ReLU1d", "ReLU3d", "LinearReLU"))}
    if name != "mobilenet_v2":  # MobileNetV2's ReLU6 is not fused into its convs (by either tool)
        assert "ConvReLU2d" in fused
    for target in ours:  # folded BN: the same weights on both sides
        mine, other = pair.ours.get_submodule(target), pair.theirs.get_submodule(target)
        if isinstance(mine, nn.Sequential):
            mine, other = mine[0], other[0]
        if hasattr(mine, "weight") and isinstance(mine.weight, torch.Tensor):
            torch.testing.assert_close(mine.weight, other.weight)
            if getattr(mine, "bias", None) is not None or getattr(other, "bias", None) is not None:
                torch.testing.assert_close(mine.bias, other.bias)


def _observer_layout(gm: fx.GraphModule, is_observer) -> list[tuple[str, int]]:
    """(observed node, index of the observer *module*, numbered by first use) for every observer."""
    layout, ids = [], {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and is_observer(gm.get_submodule(node.target)):
            module_id = id(gm.get_submodule(node.target))
            layout.append((node.args[0].name, ids.setdefault(module_id, len(ids))))
    return layout


@pytest.mark.parametrize("name", [n for n in MODELS if n not in CLAMPS_FOLDED])
def test_same_observers_and_qparams(name):
    pair = _pair(name)
    ours = _observer_layout(pair.ours, _ours_is_observer)
    theirs = _observer_layout(pair.theirs, _is_ao_observer)
    assert ours == theirs  # same values observed, same number, same sharing
    assert len({i for _, i in ours}) < len(ours)  # sharing does happen (pool / flatten / ReLU6)
    mine = [pair.ours.get_submodule(n.target).qparams() for n in pair.ours.graph.nodes
            if OBSERVER in n.meta]
    other = [pair.theirs.get_submodule(n.target).calculate_qparams() for n in pair.theirs.graph.nodes
             if n.op == "call_module" and _is_ao_observer(pair.theirs.get_submodule(n.target))]
    assert len(mine) == len(other)
    for q, (scale, zero_point) in zip(mine, other):
        assert torch.equal(q.scale.reshape(-1).float(), scale.reshape(-1).float())
        assert torch.equal(q.zero_point.reshape(-1).long(), zero_point.reshape(-1).long())


def _within_one_step(ours: torch.Tensor, theirs: torch.Tensor, step: float) -> float:
    return float(((ours - theirs).abs() <= step * 1.0001).double().mean())


def _output_step(reference: fx.GraphModule) -> float:
    quantizes = [reference.get_submodule(n.target) for n in reference.graph.nodes
                 if n.op == "call_module" and isinstance(reference.get_submodule(n.target), Quantize)]
    return float(quantizes[-1].qparams.scale)


@pytest.mark.parametrize("name", [n for n in MODELS if n not in CHAOTIC])
def test_reference_outputs_within_one_step(name):
    pair = _pair(name, reduce_range=False)
    x = pair.inputs(9, 4)
    with torch.no_grad():
        ours, theirs = pair.ours_reference(*x), pair.theirs_reference(*x)
    assert _within_one_step(ours, theirs, _output_step(pair.ours_reference)) >= 0.99


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node):
        self.values[n] = result = super().run_node(n)
        return result


@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("name", [n for n in MODELS if n not in CLAMPS_FOLDED])
def test_each_quantize_point_within_one_step(name, reduce_range):
    """Every quantize op of qplug's reference model, fed the value torch.ao quantizes there."""
    pair = _pair(name, reduce_range)
    recorder = _Recorder(pair.theirs_reference)
    with torch.no_grad():
        recorder.run(*pair.inputs(9, 2))
    theirs = [n for n in pair.theirs_reference.graph.nodes
              if n.op == "call_function" and n.target is torch.quantize_per_tensor]
    ours = [pair.ours_reference.get_submodule(n.target) for n in pair.ours_reference.graph.nodes
            if n.op == "call_module" and isinstance(pair.ours_reference.get_submodule(n.target), Quantize)]
    assert len(ours) == len(theirs) > 0
    for module, node in zip(ours, theirs):
        value, expected = recorder.values[node.args[0]], recorder.values[node]
        qp_ = module.qparams
        assert float(qp_.scale) == pytest.approx(expected.q_scale(), rel=1e-6)
        assert int(qp_.zero_point) == expected.q_zero_point()
        inside = value <= (qp_.quant_max - int(qp_.zero_point)) * float(qp_.scale)  # see docstring
        got = module(value).long()[inside]
        want = expected.int_repr().long()[inside]
        assert float(((got - want).abs() <= 1).double().mean()) >= 0.999, node.name
    # weighted modules: same reference weights, same outputs on the same input
    for name_, module in pair.ours_reference.named_modules():
        if isinstance(module, ReferenceWeighted):
            other = pair.theirs_reference.get_submodule(name_)
            probe = torch.randn_like(recorder.values[_input_of(pair.theirs_reference, name_)])
            with torch.no_grad():
                torch.testing.assert_close(module(probe), other(probe), rtol=1e-4, atol=1e-4)


def _input_of(gm: fx.GraphModule, target: str) -> fx.Node:
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == target)
    return node.args[0]


# torch.quantize_per_tensor rounds a few elements per million differently from any plain float32
# formula (its vectorised paths); ResNet-18's depth amplifies those single-step differences, so its
# end-to-end agreement is ~93% while a shallow network agrees everywhere.
@pytest.mark.parametrize("name, agreement", [("digits_cnn", 0.99), ("resnet18", 0.90)])
def test_reduce_range_reference_outputs(name, agreement):
    pair = _pair(name, reduce_range=True)
    x = pair.inputs(9, 4)
    with torch.no_grad():
        ours, theirs = pair.ours_reference(*x), pair.theirs_reference(*x)
    assert _within_one_step(ours, theirs, _output_step(pair.ours_reference)) >= agreement

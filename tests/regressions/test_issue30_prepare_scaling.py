"""Issue 30: ``prepare_fx`` does the same work per block whatever the model's length.

Timing is for ``bench/bench_prepare.py``; this test counts operations instead: the Python calls
(cProfile's ``total_calls``, which counts every resumed generator step too) that ``prepare_fx``
makes on chains of conv-bn-relu + add-relu blocks. Linear work means each extra block costs the
same number of calls on a long chain as on a short one. Before the fix, fusion's clean-up ran one
``any()`` over the graph per fused-away module (6 million steps at 800 blocks): the calls per
extra block grew by 18% from the 10..40 to the 40..160 range.
"""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + x)


def _calls(blocks: int) -> int:
    torch.manual_seed(0)
    model, inputs = nn.Sequential(*(_Block() for _ in range(blocks))).eval(), (torch.randn(1, 4, 4, 4),)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        qp.prepare_fx(model, None, inputs, backend="fbgemm")
    finally:
        profiler.disable()
    return pstats.Stats(profiler).total_calls


def test_prepare_fx_calls_per_block_do_not_grow_with_the_chain():
    _calls(2)  # plugin discovery, pattern tables and other one-time work
    short, mid, long = _calls(10), _calls(40), _calls(160)
    per_block_short = (mid - short) / 30
    per_block_long = (long - mid) / 120
    assert per_block_long <= 1.03 * per_block_short, (short, mid, long)


def _counting(monkeypatch, *targets: tuple[type, str]) -> dict[str, int]:
    """Count the calls of each ``owner.name`` (in place, through ``monkeypatch``)."""
    counts = dict.fromkeys((f"{owner.__name__}.{name}" for owner, name in targets), 0)
    for owner, name in targets:
        original = owner.__dict__.get(name) or getattr(owner, name)

        def counted(*args, __original=original, __key=f"{owner.__name__}.{name}", **kwargs):
            counts[__key] += 1
            return __original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return counts


def _prepared_chain(blocks: int) -> tuple[torch.fx.GraphModule, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model, inputs = nn.Sequential(*(_Block() for _ in range(blocks))).eval(), (torch.randn(1, 4, 4, 4),)
    return qp.prepare_fx(model, None, inputs, backend="fbgemm"), inputs


def test_prepare_fx_generates_the_graph_code_once_and_lints_it_three_times(monkeypatch):
    """Generating and compiling forward's Python costs ~0.25 s per 5,600 nodes, linting ~0.03 s:
    prepare does each only where a step needs it. Code: once, after observers are inserted (the
    GraphModule tracing builds used to generate it at once, and fusion's stage to regenerate it,
    for nothing: the passes run the graph through an Interpreter, never through ``forward``).
    Lint: before each of the two pass runs and once when fusion removes the dead nodes (fusion
    used to lint again right after that)."""
    counts = _counting(monkeypatch, (torch.fx.Graph, "python_code"), (torch.fx.Graph, "lint"))
    prepared, inputs = _prepared_chain(3)
    assert counts == {"Graph.python_code": 1, "Graph.lint": 3}
    # the code that runs is the observed graph's: calibrating goes through every observer
    observers = [m for n, m in prepared.named_modules() if "activation_post_process" in n]
    prepared(*inputs)
    assert observers and all(o.has_data for o in observers)


def test_captured_graph_generates_its_code_at_first_use():
    """The captured graph's code is left for the first call, ``.code`` or ``str()``: a plugin
    pass that runs the module between capture and the end of prepare runs the graph as it is."""
    from qplug_core.flows.pipeline import capture_graph

    torch.manual_seed(0)
    model, inputs = nn.Sequential(_Block(), _Block()).eval(), (torch.randn(1, 4, 4, 4),)
    for use in ("call", "code", "str"):
        gm = capture_graph(model, inputs, inplace=False)
        assert "_code" not in gm.__dict__
        if use == "call":
            torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)
        elif use == "code":
            assert "def forward" in gm.code
        else:
            assert "def forward" in str(gm)
        assert "_code" in gm.__dict__
    # a rewrite before the first use is what runs
    gm = capture_graph(model, inputs, inplace=False)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.mul, (output.args[0], 2.0))
    output.args = (doubled,)
    torch.testing.assert_close(gm(*inputs), 2.0 * model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("flags", ["avx2 fma", "avx2 avx512f avx512bw avx512_vnni"], ids=["no-vnni", "vnni"])
def test_prepare_fx_builds_one_observer_per_qconfig_not_one_per_node(monkeypatch, flags):
    """Building an observer (its argument checks, ``register_buffer`` calls) costs ~80 us, copying
    a built one field by field ~20 us: prepare builds one per activation factory and copies it for
    each node (2,400 observers at 800 blocks), and the copies are the observers a build gives."""
    from qplug_core.observers.base import ObserverBase

    counts = _counting(monkeypatch, (ObserverBase, "__init__"))
    built = []
    for blocks in (3, 6):
        counts["ObserverBase.__init__"] = 0
        with override_cpu_flags(flags):  # without VNNI a post-prepare check reads weight ranges too
            prepared, _ = _prepared_chain(blocks)
        built.append(counts["ObserverBase.__init__"])
    assert built[0] == built[1], built  # 9 more observers in the graph, none more built
    monkeypatch.undo()
    observers = {n: m for n, m in prepared.named_modules() if "activation_post_process" in n}
    assert len(observers) == 18
    reference = qp.get_default_qconfig_mapping("fbgemm").global_qconfig.activation()
    for name, observer in observers.items():
        assert type(observer) is type(reference), name
        state = {k: v for k, v in vars(observer).items() if k not in ("name", "_buffers")}
        assert state == {k: v for k, v in vars(reference).items() if k not in ("name", "_buffers")}
        assert observer.state_dict().keys() == reference.state_dict().keys()
        for key, value in observer.state_dict().items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=0, atol=0)
    buffers = [b.data_ptr() for o in observers.values() for b in o.buffers()]
    assert len(set(buffers)) == len(buffers)  # no two observers share a statistic


def test_folding_bn_into_conv_clones_no_conv_tensor(monkeypatch):
    """The folded conv is a copy of the conv given the folded weight and bias: cloning the conv's
    own weight and bias first, only to replace them, was one clone per tensor per fused conv."""
    from qplug_core.nn.folding import fold_bn_into_conv

    torch.manual_seed(0)
    conv, bn = nn.Conv2d(4, 4, 3).eval(), nn.BatchNorm2d(4).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    counts = _counting(monkeypatch, (torch.Tensor, "clone"))
    fused = fold_bn_into_conv(conv, bn)
    assert counts == {"Tensor.clone": 0}
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(fused(x), bn(conv(x)), rtol=1e-5, atol=1e-5)
    assert fused.weight is not conv.weight and fused.bias is not conv.bias
    assert fused.weight.data_ptr() != conv.weight.data_ptr()

"""The backend's ``post_prepare`` observer rules, applied to an eager-mode model.

Backends declare their observer rules once, as ``post_prepare`` graph passes (fbgemm: 7-bit inputs
for depthwise convs, whose kernel saturates on 8-bit ones). Eager mode has no graph, so each observed
module is shown to those passes as a graph of one call fed by its input observer: the passes read
the module and tune that observer as they would in graph mode.

Eager mode does not know which module produced an input, so it cannot narrow the producer's output
observer as graph mode does. A module whose input observer a rule changed is marked instead, and
convert requantizes its input to that observer's qparams in front of the kernel; a QAT model
fake-quantizes that input to them, so training sees the integers the kernel will get. Where a rule
narrowed the range the user's own qconfig asked for (not the backend's default), one warning per
rule names the modules, as graph mode's :mod:`qplug_core.flows.narrowed_ranges` does.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import fx, nn

from qplug_core.enums import Stage
from qplug_core.flows.narrowed_ranges import warn_narrowed
from qplug_core.flows.pipeline import plugin_passes
from qplug_core.flows.tags import EAGER_INPUT_REQUANTIZED, OBSERVER
from qplug_core.registry.backends import Backend


def _range(observer: nn.Module) -> tuple:
    inner = getattr(observer, "activation_post_process", observer)  # a fake quant's observer
    return tuple(getattr(inner, key, None) for key in ("dtype", "quant_min", "quant_max"))


def _one_call_graph(module: nn.Module, input_observer: nn.Module) -> fx.GraphModule:
    """``op(input_observer(x))`` as a graph over the model's own module and observer objects."""
    root = nn.Module()
    root.input_observer, root.op = input_observer, module
    graph = fx.Graph()
    observed = graph.call_module("input_observer", (graph.placeholder("x"),))
    observed.meta[OBSERVER] = "input"
    graph.output(graph.call_module("op", (observed,)))
    return fx.GraphModule(root, graph)


def apply_post_prepare_rules(modules: Iterable[tuple[str, nn.Module, nn.Module]], backend: Backend,
                             mode: str) -> None:
    """Run ``backend``'s post-prepare passes on each (name, module, input observer); mark the
    modules whose input observer they changed with the prepare ``mode`` and warn where that
    overrode the user's own qconfig (see the module docstring)."""
    passes = plugin_passes(backend, Stage.POST_PREPARE)
    if not passes:
        return
    default = getattr(backend.default_qconfig_mapping(mode).global_qconfig, "activation", None)
    narrowed: dict[Callable, list[tuple[str, tuple, tuple]]] = {}  # pass -> (name, old, new) of each module
    for name, module, input_observer in modules:
        graph_module = _one_call_graph(module, input_observer)
        for pass_ in passes:
            before = _range(input_observer)
            pass_(graph_module)
            after = _range(input_observer)
            if after != before:
                module.__dict__[EAGER_INPUT_REQUANTIZED] = mode
                if module.qconfig.activation != default:
                    narrowed.setdefault(pass_, []).append((name, before[1:], after[1:]))
    for pass_, layers in narrowed.items():
        _, old, new = layers[0]
        warn_narrowed(backend.name, pass_, old, new, [name for name, _, _ in layers])

"""Raise an exported ATen graph to the level the pattern set is written at.

``torch.export`` gives ``aten.linear(x, w, b)`` on ``get_attr`` weights, ``aten.relu_``,
``aten.add.Tensor``... Backends declare each pattern once, over modules and functionals
(``nn.Linear``, ``F.relu``, ``operator.add``). This pass derives the ATen form of those patterns by
rewriting the graph instead of the pattern set: each weighted ATen op becomes a ``call_module`` of
the real ``nn`` module holding its parameters, named after the module that called it (so report
keys and ``get_submodule`` names match the user's model), and each elementwise or data-movement op
becomes the functional or method target the shared patterns already name. Everything after capture
(fusion, regions, observers, lowering, report) then runs unchanged on both capture levels. ATen ops
with no counterpart stay as they are, so a backend can still match them with ATen patterns of its
own (the matcher compares ``node.target is op``).

transformers' ``Conv1D`` (``addmm(bias, x, W)`` with ``W`` stored (in, out)) becomes an
``nn.Linear`` holding ``W.t()``; a weight computed from parameters only (weight norm) is folded to a
constant first.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.flows.channel_affine import fold_channel_affines
from qplug_core.flows.normalize import record_functional_weight
from qplug_core.flows.tags import EXPORT_RANGES
from qplug_core.ir import module_stack
from qplug_core.ir.attributes import fetch_attribute
from qplug_core.ir.capture import drop_guard_call
from qplug_core.ir.hooks import drop_pre_hooks
from qplug_core.passes import ConstantFoldingPass, PassResult
from qplug_core.passes.remove_noops import remove_noops

aten = torch.ops.aten

#: ATen op -> the functional target of the shared pattern set (same positional arguments)
_FUNCTIONS: dict[Any, Callable] = {
    aten.relu.default: F.relu, aten.add.Tensor: operator.add, aten.mul.Tensor: operator.mul,
    aten.cat.default: torch.cat, aten.hardtanh.default: F.hardtanh,
    aten.chunk.default: torch.chunk, aten.split.Tensor: torch.split,  # CSP / C2f blocks
    aten.split_with_sizes.default: torch.split,
    aten.hardswish.default: F.hardswish, aten.hardsigmoid.default: F.hardsigmoid,
    aten.silu.default: F.silu,
    aten.sigmoid.default: torch.sigmoid, aten.tanh.default: torch.tanh,
    aten.leaky_relu.default: F.leaky_relu, aten.matmul.default: torch.matmul, aten.bmm.default: torch.bmm,
    aten.mm.default: torch.mm,
    aten.flatten.using_ints: torch.flatten, aten.transpose.int: torch.transpose,
    aten.adaptive_avg_pool1d.default: torch.adaptive_avg_pool1d,
    aten.adaptive_avg_pool2d.default: F.adaptive_avg_pool2d,
    aten.adaptive_avg_pool3d.default: F.adaptive_avg_pool3d,
    aten.max_pool1d.default: F.max_pool1d, aten.max_pool2d.default: F.max_pool2d,
    aten.max_pool3d.default: F.max_pool3d, aten.avg_pool1d.default: torch.avg_pool1d,
    aten.avg_pool2d.default: F.avg_pool2d, aten.avg_pool3d.default: F.avg_pool3d,
    aten.mean.dim: torch.mean, aten.clamp.default: torch.clamp, aten.clip.default: torch.clip,
    aten.unsqueeze.default: torch.unsqueeze, aten.squeeze.dim: torch.squeeze,
    aten.pixel_shuffle.default: F.pixel_shuffle, aten.elu.default: F.elu,
    aten.relu6.default: F.relu6, aten.narrow.default: torch.narrow, aten.pad.default: F.pad,
}
#: ATen upsample op -> the ``F.interpolate`` mode computing it: the modes fbgemm's and qnnpack's
#: kernels run on int8 tensors (torch has no quantized 1-d nearest, linear, bicubic or trilinear)
_INTERPOLATE: dict[Any, str] = {
    aten.upsample_nearest2d: "nearest", aten.upsample_nearest3d: "nearest",
    aten._upsample_nearest_exact2d: "nearest-exact", aten._upsample_nearest_exact3d: "nearest-exact",
    aten.upsample_bilinear2d: "bilinear",
}
#: in-place ATen ops and their out-of-place forms, used when nothing else reads the mutated input
_OUT_OF_PLACE: dict[Any, Any] = {
    aten.relu_.default: aten.relu.default, aten.add_.Tensor: aten.add.Tensor,
    aten.mul_.Tensor: aten.mul.Tensor, aten.hardtanh_.default: aten.hardtanh.default,
    aten.hardswish_.default: aten.hardswish.default, aten.sigmoid_.default: aten.sigmoid.default,
    aten.tanh_.default: aten.tanh.default, aten.clamp_.default: aten.clamp.default,
    aten.clip_.default: aten.clip.default,
    aten.leaky_relu_.default: aten.leaky_relu.default, aten.elu_.default: aten.elu.default,
    aten.hardsigmoid_.default: aten.hardsigmoid.default, aten.silu_.default: aten.silu.default,
}
#: ATen op -> Tensor method name (the shared patterns list reshapes as methods)
_METHODS = {aten.view.default: "view", aten.reshape.default: "reshape",
            aten.permute.default: "permute", aten.contiguous.default: "contiguous",
            aten.repeat.default: "repeat"}
#: ATen ops that only check or restate what the graph already guarantees
_CHECKS = (aten._assert_tensor_metadata.default,)

_CONV = {aten.conv1d.default: nn.Conv1d, aten.conv2d.default: nn.Conv2d,
         aten.conv3d.default: nn.Conv3d, aten.conv1d.padding: nn.Conv1d,
         aten.conv2d.padding: nn.Conv2d, aten.conv3d.padding: nn.Conv3d}
_CONV_TRANSPOSE = {aten.conv_transpose1d.default: nn.ConvTranspose1d,
                   aten.conv_transpose2d.input: nn.ConvTranspose2d,
                   aten.conv_transpose3d.input: nn.ConvTranspose3d}
#: the modules a layer made from a linear/conv/matmul call becomes (recorded for qp.compare)
_FROM_CALLS = (nn.Linear, *_CONV.values(), *_CONV_TRANSPOSE.values())
_BATCH_NORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def is_aten_graph(gm: nn.Module) -> bool:
    """Whether ``gm`` is a GraphModule of ATen ops (what ``ExportedProgram.module()`` returns)."""
    return isinstance(gm, fx.GraphModule) and any(
        n.op == "call_function" and str(n.target).startswith("aten.") for n in gm.graph.nodes)


def exported_module(program: torch.export.ExportedProgram) -> fx.GraphModule:
    """``program.module()`` (a fresh module: the program is never modified), its
    ``range_constraints`` in ``meta[EXPORT_RANGES]``, where a copy of the module keeps them (qplug
    copies a model before changing it): the user's program is checked for all its guards
    (:mod:`qplug_core.flows.input_relations`), qplug's own capture (its batch widened to 2 for
    export) for fixed and equal sizes only."""
    gm = program.module()
    gm.meta[EXPORT_RANGES] = dict(program.range_constraints)
    return gm


def raise_aten_graph(gm: fx.GraphModule) -> PassResult:
    """Rewrite an exported GraphModule in place (see module docstring); returns a PassResult.

    Node meta stays in the form torch.export wrote it (``nn_module_stack`` with class names as
    strings, :mod:`qplug_core.ir.module_stack`): a partition of this graph is exported again
    (ONNX), and torch.export checks that form.
    """
    _drop_guards(gm)
    training = _records_training(gm)
    for disabled in ("train", "eval"):  # ExportedProgram.module() refuses both; raised modules need them
        gm.__dict__.pop(disabled, None)
    _remove_noops(gm)
    _out_of_place(gm)  # before folding: an in-place op on a folded constant would mutate it
    ConstantFoldingPass()(gm)
    _Raiser(gm).run()
    fold_channel_affines(gm)  # frozen BatchNorms: folded into the conv before them
    _remove_noops(gm)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    _plain_calling_convention(gm)
    gm.graph.lint()
    gm.recompile()
    gm.train(training)  # the raised modules run in the mode the graph was exported in
    return PassResult(gm, True)


def _plain_calling_convention(gm: fx.GraphModule) -> None:
    """Positional tensors in, a tensor or tuple out: drop export's pytree flattening code.

    The graph then calls like a symbolically traced one, and ``qp.save`` (which stores the graph,
    not its Python codegen) reloads a model with the same calling convention. Other input or
    output structures (keyword inputs, dict outputs) keep the pytree code.
    """
    in_spec, out_spec = getattr(gm, "_in_spec", None), getattr(gm, "_out_spec", None)
    if in_spec is None or out_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        return
    args, kwargs = in_spec.children()
    if args.type is not tuple or not all(c.is_leaf() for c in args.children()) \
            or kwargs.num_children != 0:
        return
    output = gm.graph.output_node()
    if out_spec.is_leaf() and isinstance(output.args[0], (tuple, list)) and len(output.args[0]) == 1:
        output.args = (output.args[0][0],)
    elif not (out_spec.type is tuple and all(c.is_leaf() for c in out_spec.children())):
        return
    gm.graph.set_codegen(fx.graph.CodeGen())


def _records_training(gm: fx.GraphModule) -> bool:
    """Whether the graph was exported in training mode (batch norm or dropout say so)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.batch_norm.default, aten.dropout.default):
            flag = node.args[5] if node.target is aten.batch_norm.default else node.args[2]
            if flag is True:
                return True
    return False


def _out_of_place(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _OUT_OF_PLACE and _only_reader(node):
            node.target = _OUT_OF_PLACE[node.target]


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input-shape guards, its ``_guards_fn`` call (it would read as a float op in
    the report) and its pre-hook (a raw RuntimeError, run only where convert keeps this module):
    the observed and the converted model check what export assumed of the inputs themselves,
    with a qplug error (:mod:`qplug_core.flows.exported_inputs`), also after ``qp.load``."""
    drop_guard_call(gm)
    drop_pre_hooks(gm, lambda hook: getattr(hook, "__name__", "") == _EXPORT_INPUT_CHECK)


#: the name of the forward pre-hook ``ExportedProgram.module()`` checks its inputs with
_EXPORT_INPUT_CHECK = "_check_input_constraints_pre_hook"


def _remove_noops(gm: fx.GraphModule) -> None:
    """The no-ops of every level (``passes/remove_noops.py``), then the shape checks export adds
    (the raised ops check shapes anyway; a check would read as a float op in the report)."""
    remove_noops(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CHECKS and not node.users:
            gm.graph.erase_node(node)


def _ndim_of(node: Any) -> int | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else None


class _Raiser:
    """Turns weighted ATen ops into module calls and the rest into pattern-set targets."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.claimed: set[str] = set()
        self.attr_users: dict[str, int] = {}
        self.batch_counters: dict[str, fx.Node] = {}  # num_batches_tracked target -> its add_
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self.attr_users[node.target] = self.attr_users.get(node.target, 0) + len(node.users)
            elif (node.op == "call_function" and node.target is aten.add_.Tensor and not node.users
                  and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"):
                self.batch_counters[node.args[0].target] = node

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.op != "call_function":
                continue
            module = self._module_for(node)
            if module is not None:
                self._replace_with_module(node, *module)
            elif node.target in _FUNCTIONS and _plain_kwargs(node):
                node.target = _FUNCTIONS[node.target]
            elif (interpolation := _as_interpolate(node)) is not None:
                node.target, node.args, node.kwargs = F.interpolate, (node.args[0],), interpolation
            elif (index := _as_index(node)) is not None:
                node.target, node.args, node.kwargs = operator.getitem, (node.args[0], index), {}
            elif node.target is aten.constant_pad_nd.default:  # what F.pad and ZeroPad1d decompose to
                node.target, node.kwargs = F.pad, {}
                node.args = (node.args[0], node.args[1], "constant", _arg(node, 2, "value", 0.0))
            elif node.target in _METHODS:
                node.op, node.target = "call_method", _METHODS[node.target]

    # -- weighted ops ------------------------------------------------------------------------------

    def _module_for(self, node: fx.Node) -> tuple[nn.Module, fx.Node, list[fx.Node]] | None:
        """(module, its input, the get_attr nodes it absorbs) for a weighted op, else None."""
        target, args = node.target, node.args
        if target is aten.linear.default:
            return self._linear(node, args[0], _arg(node, 1, "weight"), _arg(node, 2, "bias"),
                                transposed=False)
        if target is aten.addmm.default and not node.kwargs:
            return self._linear(node, args[1], args[2], args[0], transposed=True)
        if target in (aten.mm.default, aten.matmul.default) and not node.kwargs:
            return self._linear(node, args[0], args[1], None, transposed=True)
        if target in _CONV:
            return self._conv(node, _CONV[target], transposed=False)
        if target in _CONV_TRANSPOSE:
            return self._conv(node, _CONV_TRANSPOSE[target], transposed=True)
        if target is aten.embedding.default:
            return self._embedding(node)
        if target is aten.layer_norm.default:
            return self._layer_norm(node)
        if target is aten.group_norm.default:
            return self._group_norm(node)
        if target is aten.prelu.default:  # the shared patterns have the module form only
            return self._prelu(node)
        if target is aten.batch_norm.default:
            return self._batch_norm(node, *args[1:5], training=bool(_arg(node, 5, "training")),
                                    momentum=_arg(node, 6, "momentum"), eps=_arg(node, 7, "eps"))
        if target is aten._native_batch_norm_legit_no_training.default:
            return self._batch_norm(node, *args[1:5], training=False, momentum=args[5], eps=args[6])
        if target is aten.dropout.default and isinstance(args[1], float):
            # training-mode dropout (eval-mode dropout is removed before): a module, so that
            # model.eval() turns it off as it does in the user's model
            return nn.Dropout(args[1]), args[0], []
        return None

    def _tensor(self, node: Any) -> torch.Tensor | None:
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = fetch_attribute(self.gm, node.target)
            return value if isinstance(value, torch.Tensor) else None
        return None

    def _linear(self, node, x, weight_node, bias_node, *, transposed: bool):
        weight, bias = self._tensor(weight_node), self._tensor(bias_node)
        if weight is None or weight.dim() != 2 or (bias_node is not None and (bias is None or bias.dim() != 1)):
            return None
        if transposed and _ndim_of(x) not in (None, 2) and node.target is not aten.matmul.default:
            return None
        module = nn.Linear(1, 1, bias=bias is not None)
        module.in_features, module.out_features = (weight.shape[0], weight.shape[1]) if transposed \
            else (weight.shape[1], weight.shape[0])
        module.weight = _parameter(weight.t().contiguous() if transposed else weight)
        if bias is not None:
            module.bias = _parameter(bias)
        return module, x, [n for n in (weight_node, bias_node) if n is not None]

    def _conv(self, node, conv_class: type[nn.Module], *, transposed: bool):
        x, weight_node, bias_node = node.args[0], node.args[1], _arg(node, 2, "bias")
        weight, bias = self._tensor(weight_node), self._tensor(bias_node)
        if weight is None or (bias_node is not None and bias is None):
            return None
        dims = weight.dim() - 2
        names = (("stride", 1), ("padding", 0), ("output_padding", 0), ("groups", 1),
                 ("dilation", 1)) if transposed else (
            ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
        settings = {name: _arg(node, 3 + i, name, default) for i, (name, default) in enumerate(names)}
        if any(isinstance(v, fx.Node) for v in settings.values()):
            return None
        groups = settings["groups"]
        out_channels, in_channels = (weight.shape[1] * groups, weight.shape[0]) if transposed \
            else (weight.shape[0], weight.shape[1] * groups)
        for key in ("stride", "padding", "dilation", "output_padding"):
            if key in settings and isinstance(settings[key], (list, tuple)) and len(settings[key]) == 1:
                settings[key] = (settings[key][0],) * dims
        module = conv_class(in_channels, out_channels, tuple(weight.shape[2:]), bias=bias is not None,
                            **settings)
        module.weight = _parameter(weight)
        if bias is not None:
            module.bias = _parameter(bias)
        return module, x, [n for n in (weight_node, bias_node) if n is not None]

    def _embedding(self, node):
        weight_node, indices = node.args[0], node.args[1]
        weight = self._tensor(weight_node)
        padding_idx = _arg(node, 2, "padding_idx", -1)
        if weight is None or weight.dim() != 2 or _arg(node, 4, "sparse", False) \
                or _arg(node, 3, "scale_grad_by_freq", False):
            return None
        module = nn.Embedding(weight.shape[0], weight.shape[1],
                              padding_idx=None if padding_idx < 0 else padding_idx)
        module.weight = _parameter(weight)
        return module, indices, [weight_node]

    def _prelu(self, node):
        weight_node = node.args[1]
        weight = self._tensor(weight_node)
        if weight is None or weight.dim() != 1:
            return None
        module = nn.PReLU(weight.numel())
        module.weight = _parameter(weight)
        return module, node.args[0], [weight_node]

    def _norm_affine(self, node):
        """(weight node, bias node, weight, bias) at args 2 and 3 of a layer/group norm, or None
        when one of them is computed rather than a stored tensor."""
        weight_node, bias_node = _arg(node, 2, "weight"), _arg(node, 3, "bias")
        weight, bias = self._tensor(weight_node), self._tensor(bias_node)
        if (weight_node is not None and weight is None) or (bias_node is not None and bias is None):
            return None
        return weight_node, bias_node, weight, bias

    def _with_affine(self, module, x, affine):
        weight_node, bias_node, weight, bias = affine
        if weight is not None:
            module.weight = _parameter(weight)
        if bias is not None:
            module.bias = _parameter(bias)
        return module, x, [n for n in (weight_node, bias_node) if n is not None]

    def _layer_norm(self, node):
        affine = self._norm_affine(node)
        if affine is None:
            return None
        module = nn.LayerNorm(list(node.args[1]), eps=_arg(node, 4, "eps", 1e-5),
                              elementwise_affine=affine[2] is not None, bias=affine[3] is not None)
        return self._with_affine(module, node.args[0], affine)

    def _group_norm(self, node):
        """The shared patterns name the module (UNets and VAEs write ``nn.GroupNorm``)."""
        affine = self._norm_affine(node)
        x_value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if affine is None or (affine[2] is None) != (affine[3] is None) or x_value is None:
            return None
        module = nn.GroupNorm(node.args[1], x_value.shape[1], eps=_arg(node, 4, "eps", 1e-5),
                              affine=affine[2] is not None)
        return self._with_affine(module, node.args[0], affine)

    def _batch_norm(self, node, weight_node, bias_node, mean_node, var_node, *, training: bool,
                    momentum, eps):
        x = node.args[0]
        weight, bias = self._tensor(weight_node), self._tensor(bias_node)
        mean, var = self._tensor(mean_node), self._tensor(var_node)
        bn_class = _BATCH_NORM.get(_ndim_of(x))
        if bn_class is None or mean is None or var is None or (weight_node is not None and weight is None):
            return None
        module = bn_class(mean.shape[0], eps=eps, momentum=momentum, affine=weight is not None)
        if weight is not None:
            module.weight = _parameter(weight)
            module.bias = _parameter(bias)
        module.running_mean, module.running_var = mean, var
        absorbed = [n for n in (weight_node, bias_node, mean_node, var_node) if n is not None]
        if node.target is aten._native_batch_norm_legit_no_training.default:
            return self._first_output_only(node, module, x, absorbed)
        self._absorb_batch_counter(mean_node, module)
        return module, x, absorbed

    def _first_output_only(self, node, module, x, absorbed):
        """``_native_batch_norm_legit_no_training`` returns (out, mean, invstd): only ``out`` read."""
        getters = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in getters):
            return None
        for user in getters:
            user.replace_all_uses_with(node)
            self.gm.graph.erase_node(user)
        return module, x, absorbed

    def _absorb_batch_counter(self, mean_node: fx.Node, module: nn.Module) -> None:
        """Training IR increments ``num_batches_tracked`` beside the op; the module now does."""
        counter = mean_node.target.rpartition(".")[0] + ".num_batches_tracked"
        increment = self.batch_counters.pop(counter, None)
        if increment is not None:
            module.num_batches_tracked = fetch_attribute(self.gm, counter)
            source = increment.args[0]
            self.gm.graph.erase_node(increment)
            self.attr_users[source.target] -= 1
            if not source.users:
                self.gm.graph.erase_node(source)

    def _replace_with_module(self, node: fx.Node, module: nn.Module, x: fx.Node,
                             absorbed: list[fx.Node]) -> None:
        name = self._module_name(node, absorbed)
        if isinstance(module, _FROM_CALLS) and absorbed and name != absorbed[0].target.rpartition(".")[0]:
            record_functional_weight(self.gm, name, str(absorbed[0].target))  # not the weight's own module
        self.gm.add_submodule(name, module)
        self.claimed.add(name)
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_module(name, args=(x,))
        new.meta = dict(node.meta)
        stack = dict(new.meta.get(module_stack.KEY) or {})
        if name not in (path for path, _ in stack.values()):
            key, value = module_stack.entry(stack, name, type(module))
            stack[key] = value
        new.meta[module_stack.KEY] = stack
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)
        for attr in absorbed:
            self.attr_users[attr.target] -= 1
            if not attr.users:
                self.gm.graph.erase_node(attr)

    def _module_name(self, node: fx.Node, absorbed: list[fx.Node]) -> str:
        """The user's module path for the op when that path is free to take, else a fresh name.

        Tried in order: the module owning the weight (``...query`` for a Linear, ``...c_attn`` for
        a Conv1D), a child named after a ``<name>_weight`` parameter (``self_attn.in_proj``), and
        the module whose forward called the op (a conv whose weight was folded from weight norm).
        """
        owner, _, attr = absorbed[0].target.rpartition(".") if absorbed else ("", "", "")
        candidates = [owner]
        if owner and attr.endswith("_weight"):
            candidates.append(f"{owner}.{attr[:-len('_weight')]}")
        candidates.append(module_stack.innermost(node)[0])
        for path in candidates:
            if path and path not in self.claimed and self._free_to_replace(path, absorbed):
                return path
        base, suffix = f"{node.name}_module", 0
        name = base
        while hasattr(self.gm, name):
            suffix += 1
            name = f"{base}_{suffix}"
        return name

    def _free_to_replace(self, path: str, absorbed: list[fx.Node]) -> bool:
        """Replacing the container at ``path`` loses nothing another node still reads: no other
        live attribute under it, no module raised inside or around it, a weight read only here."""
        mine = {a.target for a in absorbed}
        prefix = path + "."
        if any(self.attr_users.get(t, 0) > 1 for t in mine):
            return False  # a weight shared by two ops: each keeps reading the attribute
        if any(t.startswith(prefix) and users > 0 and t not in mine
               for t, users in self.attr_users.items()):
            return False
        return not any(c.startswith(prefix) or path.startswith(c + ".") for c in self.claimed)


#: ATen op -> the name the shared patterns give the op computing it, where the two names differ
_PATTERN_NAMES = {"addmm": "linear", "mm": "matmul", "bmm": "matmul", "floor_divide": "floordiv",
                  "constant_pad_nd": "pad", "select": "getitem", "slice": "getitem"}


def pattern_level_name(op: str) -> str:
    """The name the shared patterns give what ATen op ``op`` (overload stripped) computes, so a
    report can tell an op qplug does not raise from one no pattern names: ``gelu`` -> ``gelu``,
    ``addmm`` -> ``linear``, ``upsample_bicubic2d`` -> ``interpolate``."""
    if op.lstrip("_").startswith("upsample"):
        return "interpolate"
    return _PATTERN_NAMES.get(op, op)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _as_interpolate(node: fx.Node) -> dict[str, Any] | None:
    """The keyword arguments of the ``F.interpolate`` call that computes exactly what upsample
    ``node`` computes (it makes the same ATen call), or None.

    The ``.vec`` overloads take an output size or scale factors (kept as given: the source index
    comes from the scale factor, not from the rounded output size), as ``F.interpolate`` does. The
    plain overloads take an output size plus optional scales; with scales, ``F.interpolate`` has
    no call for both, so the op stays ATen."""
    packet = getattr(node.target, "overloadpacket", None)
    mode = _INTERPOLATE.get(packet)
    if mode is None or node.target not in (packet.vec, packet.default):
        return None
    corners = {"align_corners": _arg(node, 2, "align_corners")} if mode == "bilinear" else {}
    first_scale = 2 + len(corners)
    scales = None
    if node.target is packet.vec:
        scales = _arg(node, first_scale, "scale_factors")
    elif any(v is not None for v in (*node.args[first_scale:],
                                     *(v for k, v in node.kwargs.items() if k.startswith("scales")))):
        return None
    return {"size": _arg(node, 1, "output_size"), "scale_factor": scales, "mode": mode, **corners}


def _as_index(node: fx.Node) -> tuple | None:
    """The index ``x[...]`` with which Python writes ``aten.slice.Tensor`` ``node`` (a TCN's chomp
    ``x[..., :-pad]``) or ``aten.select.int`` (``x[:, 0]``), so the shared pattern set's ``getitem``
    matches it, or None."""
    if node.target is aten.slice.Tensor:
        dim, start, end, step = (_arg(node, i, name, default) for i, name, default in
                                 ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
        item: Any = slice(start, None if end == sys.maxsize else end, None if step == 1 else step)
    elif node.target is aten.select.int:
        dim, item = _arg(node, 1, "dim"), _arg(node, 2, "index")
    else:
        return None
    if not isinstance(dim, int):
        return None
    return (slice(None),) * dim + (item,) if dim >= 0 else (Ellipsis, item) + (slice(None),) * (-dim - 1)


def _plain_kwargs(node: fx.Node) -> bool:
    """ATen overloads whose extra keyword arguments (``alpha``) have no functional counterpart."""
    return not node.kwargs


def _only_reader(node: fx.Node) -> bool:
    """An in-place op may become out-of-place when nothing else reads its mutated input."""
    first = node.args[0] if node.args else None
    return isinstance(first, fx.Node) and len(first.users) == 1 and first.op != "get_attr" \
        and first.op != "placeholder"


def _parameter(value: torch.Tensor) -> nn.Parameter:
    if isinstance(value, nn.Parameter):
        return value
    return nn.Parameter(value.detach(), requires_grad=False)

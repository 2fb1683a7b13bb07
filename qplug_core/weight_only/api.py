"""``qp.quantize_weights``: weight-only int8/int4 quantization by module swap, on a copy.

The copy keeps the user's model class, so a Hugging Face ``PreTrainedModel`` keeps ``generate()``,
its KV cache and its config: only its ``nn.Linear`` / ``Conv1D`` / ``nn.Embedding`` /
``nn.EmbeddingBag`` children are replaced by :class:`~qplug_core.weight_only.modules.WeightOnlyLinear` /
:class:`~qplug_core.weight_only.modules.WeightOnlyEmbedding` (``WeightOnlyEmbeddingBag``), each running the fastest correct
kernel found on this CPU (:mod:`qplug_core.weight_only.selection`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qplug_core.errors import (
    CalibrationError,
    ConfigValidationError,
    NothingQuantizedError,
    did_you_mean,
    spelled,
    warn_user,
)
from qplug_core.flows.checks import check_model, check_weight_values, refuse_quantized
from qplug_core.flows.renamed_keywords import renamed_keywords
from qplug_core.flows.tags import WEIGHT_ONLY
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.kernels.layer_faults import name_layers
from qplug_core.kernels.weight_only import DequantizedKernel, ReferenceKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme, quantize
from qplug_core.nn.computed_weights import copy_model, without_computed_weights
from qplug_core.registry.backends import Backend
from qplug_core.weight_only import decode_step
from qplug_core.weight_only.awq import GPTQ_ROWS, MAX_ROWS, awq_quantize, shared_input_scales
from qplug_core.weight_only.batches import calibration_batches, call_model, decoder_started
from qplug_core.weight_only.float_convolutions import float_convolutions_warning
from qplug_core.weight_only.fusion import fuse, shared_inputs
from qplug_core.weight_only.gptq import gptq_quantize
from qplug_core.weight_only.modules import WeightOnlyEmbedding, WeightOnlyEmbeddingBag, WeightOnlyLinear
from qplug_core.weight_only.selection import (
    Choice,
    available_kernels,
    choose,
    reuse,
    slower_than_float,
    warn_failed,
)
from qplug_core.weight_only.sequential import calibrate

#: the attribute of a quantized model holding its :class:`WeightOnlyInfo` (``qp.save`` reads it)
INFO_ATTRIBUTE = WEIGHT_ONLY
ALGORITHMS = ("rtn", "awq", "gptq")
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


@dataclass
class WeightOnlyInfo:
    """What :func:`quantize_weights` did: the scheme, the layers swapped (name -> kind), the
    kernel each linear runs, the layers left float and why, and the kernel measurements."""

    scheme: WeightOnlyScheme
    algorithm: str
    layers: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)
    #: linears reading one input that run as one kernel call (:mod:`~qplug_core.weight_only.fusion`)
    fused: list[tuple[str, ...]] = field(default_factory=list)
    #: how those groups were looked for, or why they were not
    fusion: str = ""
    #: how AWQ / GPTQ recorded their calibration inputs: block by block, or the whole model at once and why
    calibration: str = ""
    #: (machine, :attr:`~qplug_core.kernels.cpu.CpuInt8.int8_capabilities`) of the CPU the kernels
    #: were chosen on (a loaded file's, which ``qp.save`` writes again); ``None``: not known
    kernel_cpu: tuple[str, frozenset[str]] | None = None


@renamed_keywords(calibration="calibration_data")
def quantize_weights(model: nn.Module, *, bits: int = 8, group_size: int | None = None,
                     symmetric: bool = True, algorithm: str = "rtn",
                     calibration_data: Iterable[Any] | None = None, skip: str | Sequence[str] = (),
                     embeddings: bool = False, linears: bool = True, backend: str | Backend | None = None,
                     kernel: str | None = None) -> nn.Module:
    """A copy of ``model`` (eval mode) whose linear and embedding weights are ``bits``-bit integers.

    :param bits: 8 or 4.
    :param group_size: input features per scale (32, 64, 128...); ``None`` gives one scale per
        output channel. It must divide every quantized layer's input features.
    :param symmetric: fixed zero point (``True``) or one zero point per group (``False``).
    :param algorithm: ``"rtn"`` (round to nearest, no data), ``"awq"`` (activation-aware scales
        and clipping, searched on ``calibration_data``) or ``"gptq"`` (error feedback through the
        inputs' Hessian); embeddings always use RTN.
    :param calibration_data: batches the model is called with for ``"awq"`` / ``"gptq"``: token-id tensors
        (``model(batch)``), dicts (``model(**batch)``) or tuples (``model(*batch)``); a bare tensor
        is one batch.
    :param skip: module names or regular expressions (matched against the whole name) of layers to
        leave float. An output projection tied to the input embedding (``lm_head`` of most LLMs)
        is always left float: quantizing one copy would untie them.
    :param embeddings: also quantize ``nn.Embedding`` and ``nn.EmbeddingBag`` tables (rows grouped like
        linear weights):
        it saves memory (sum/mean bags with one scale per row run torch's fused bag ops, about as
        fast as float; other lookups are slower), and int4 tables cost accuracy on small models, so
        it is opt-in.
    :param linears: quantize the ``nn.Linear`` (and ``Conv1D``) layers; ``linears=False`` with
        ``embeddings=True`` quantizes only the tables (a recommendation model's small MLPs gain
        nothing from weight-only int8, and ``group_size`` then applies to the tables alone).
    :param backend: take kernels from this backend only (and the core's), by name or as a
        ``Backend`` (``qp.get_backend(...)``); ``None``: every installed backend.
    :param kernel: force a kernel by name (``"reference"``, ``"torch-int8pack"``,
        ``"torch-int4pack"``, ``"onnxruntime-matmulnbits"``...) instead of measuring.
    :return: the quantized copy, with a :class:`WeightOnlyInfo` as ``.qplug_weight_only``; a
        decoder's one-token decode steps run on one thread where that measures faster
        (:mod:`~qplug_core.weight_only.decode_step`, ``.qplug_decode_threads``).

    The model given is never modified.
    """
    check_model(model)
    scheme = WeightOnlyScheme(bits=bits, group_size=group_size, symmetric=symmetric)
    if not (linears or embeddings):
        raise ConfigValidationError("linears=False and embeddings=False leave nothing to quantize: pass "
                                    "embeddings=True to quantize only the embedding tables", field="linears",
                                    value=linears)
    if algorithm not in ALGORITHMS:
        raise ConfigValidationError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
                                    f"{did_you_mean(str(algorithm), ALGORITHMS)}", field="algorithm",
                                    value=algorithm)
    if algorithm != "rtn" and calibration_data is None:
        raise CalibrationError(f"algorithm={algorithm!r} needs calibration_data=[batch, ...]: a few token batches of "
                               "the kind of text the model will see (or use algorithm='rtn')")
    calibration = calibration_batches(calibration_data, model)
    if algorithm != "rtn":
        calibration = list(calibration)  # run more than once: block by block, or again for the whole model
    patterns = skip_patterns(skip)
    refuse_quantized(model)
    check_weight_values(model)
    kernels = available_kernels(backend)
    qmodel = own_copy(model).eval()  # as every flow returns it; no dropout in what GPTQ/AWQ fit to
    info = WeightOnlyInfo(scheme, algorithm)
    targets = _targets(qmodel, patterns, linears, embeddings, info)
    if not targets:
        raise nothing_quantized(" or ".join(["nn.Linear"] * linears + ["nn.Embedding(Bag)"] * embeddings),
                                info.skipped)
    for name, module in targets.items():
        _check_divisible(name, module, scheme, embeddings)
    linears = {n: m for n, m in targets.items() if not isinstance(m, _EMBEDDINGS)}
    # found on the float copy, before any kernel is packed: a group packs once, for its stack
    groups, info.fusion = sibling_groups(qmodel, linears, calibration)
    dtypes = {name: linear_weight(module).dtype for name, module in linears.items()}
    del linears, module
    modules = dict(qmodel.named_modules())
    dequantized: list[WeightOnlyLinear] = []  # the block calibrated last, which runs again on every batch

    def swap(inputs: dict[str, torch.Tensor | None]) -> None:
        # each float layer of the copy (and its recorded inputs) is let go as soon as it is swapped:
        # held to the end, the copy's float weights stayed resident beside the int ones (2.7x fp32)
        for layer in dequantized:  # its block has run again: its float copies go
            layer.use_kernel(ReferenceKernel(), layer.quantized_weight())
        dequantized.clear()
        recorded = {name: x for name, x in inputs.items() if x is not None}
        weights = {name: linear_weight(targets[name]) for name in recorded}
        input_scales = shared_input_scales(weights, recorded, groups, scheme) if algorithm == "awq" else {}
        calibrated = set(recorded)
        del weights, recorded
        for name in [name for name in targets if name in inputs]:
            swapped = _quantized_module(targets.pop(name), scheme, inputs.pop(name), algorithm,
                                        input_scales.get(name))
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, swapped)
            del modules[name]
            info.layers[name] = layer_kind(swapped)
            if name in calibrated and isinstance(swapped, WeightOnlyLinear):  # dequantized once the float one is gone
                kernel = DequantizedKernel(dtypes[name])
                swapped.use_kernel(kernel, kernel.pack(swapped.quantized_weight()))
                dequantized.append(swapped)

    with torch.no_grad():
        if algorithm != "rtn":
            rows = GPTQ_ROWS if algorithm == "gptq" else MAX_ROWS
            info.calibration = calibrate(qmodel, list(dtypes), calibration, rows, swap)
        swap(dict.fromkeys(targets))  # RTN: embeddings, and linears the calibration never reached
    choose_kernels(qmodel, info, groups, kernels, dtypes, kernel)
    cpu = cpu_int8()
    info.kernel_cpu = cpu.machine, cpu.int8_capabilities
    for warning in (slower_than_float(info.choices), float_convolutions_warning(model)):
        if warning:
            warn_user(warning)
    setattr(qmodel, INFO_ATTRIBUTE, info)
    decode_step.install(qmodel.eval())  # the swapped layers too: the whole copy in eval mode
    name_layers(qmodel)
    return qmodel


def choose_kernels(model: nn.Module, info: WeightOnlyInfo | None, groups: list[tuple[str, ...]], kernels: list,
                   dtypes: dict[str, torch.dtype], forced: str | None = None,
                   recorded: Mapping[str, tuple[str, int | None]] | None = None) -> dict[str, str]:
    """Give the swapped linears named in ``dtypes`` (name -> activation dtype) their kernels: one
    call for each group of linears reading one input that can be joined, the fastest correct
    kernel of its own for every other; and say so in ``info``. A layer ``recorded`` (name ->
    :func:`~qplug_core.weight_only.selection.recorded_as`, a file's record) keeps that kernel where
    it runs here; returns the recorded layers measured again instead, with why."""
    modules = dict(model.named_modules())
    changed: dict[str, str] = {}

    def pick(names: tuple[str, ...], weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
        record = (recorded or {}).get(names[0])
        if record is not None:
            reused = reuse(weight, kernels, dtype, *record)
            if not isinstance(reused, str):
                return (*reused, None)
            changed.update(dict.fromkeys(names, reused))
        return choose(weight, kernels, dtype, forced=forced)

    for name, dtype in dtypes.items():
        modules[name].activation_dtype = dtype
    joined, refused = fuse(model, groups, dtypes, pick)
    chosen: list[tuple[list[str], Choice | None]] = [(list(names), measured) for names, measured in joined]
    for name, dtype in dtypes.items():
        module = modules[name]
        if module.fused is None:
            kernel, packed, measured = pick((name,), module.quantized_weight(), dtype)
            module.use_kernel(kernel, packed)
            chosen.append(([name], measured))
    warn_failed([measured for _, measured in chosen if measured is not None])
    if info is None:
        return changed
    if refused:
        info.fusion += "; not joined: " + "; ".join(f"{', '.join(names)} ({why})"
                                                    for names, why in refused.items())
    info.fused.extend(tuple(names) for names, _ in chosen if modules[names[0]].fused is not None)
    for names, measured in chosen:
        info.kernels.update({name: modules[name].kernel.name for name in names})
        if measured is not None:
            info.choices.append(measured)
    return changed


#: what a user can do when the layers reading one input were not looked for or not found
_SIBLINGS_ADVICE = "pass calibration_data=[batch] to let qplug find the layers reading one input (q/k/v)"


def sibling_groups(model: nn.Module, linears: dict[str, nn.Module], calibration: Iterable[Any]
                   ) -> tuple[list[tuple[str, ...]], str]:
    """The ``linears`` of ``model`` that read one input, found by running it once on its own
    ``dummy_inputs`` (Hugging Face models) or, where there are none or they do not fit, the first
    calibration batch of a list, and how they were looked for; none when neither works (the layers
    then run one kernel call each, and the line says how to help). ``model`` is in eval mode
    (quantize_weights' copy): the run updates no running statistics."""
    first = calibration[0] if isinstance(calibration, (list, tuple)) and calibration else None
    dummy, skipped = _dummy_inputs(model)
    examples = [(source, example) for source, example in (
        ("the model's dummy_inputs", dummy), ("the first calibration batch", first)) if example is not None]
    failures = [skipped] if skipped else []
    for source, example in examples:
        try:
            return shared_inputs(lambda: call_model(model, example), linears), f"looked for on {source}"
        except Exception as exc:  # an example that does not fit: nothing joined, nothing lost
            failures.append(f"the run on {source} raised {type(exc).__name__}: {exc}")
    advice = "" if first is not None else f"; {_SIBLINGS_ADVICE}"
    if not examples:
        why = skipped or "the model has no dummy_inputs"
        return [], f"not looked for: {why} and calibration is not a list of batches{advice}"
    return [], f"not found: {'; '.join(failures)}{advice}"


def _dummy_inputs(model: nn.Module) -> tuple[Any, str]:
    """The model's ``dummy_inputs`` (an encoder-decoder's with its decoder start token), or None and
    why they are not used: Whisper's are token ids, its main input is float ``input_features``."""
    dummy = getattr(model, "dummy_inputs", None)
    main = getattr(model, "main_input_name", None)
    if dummy is not None and hasattr(dummy, "keys") and isinstance(main, str) and main not in dummy:
        return None, (f"{type(model).__name__}'s dummy_inputs ({', '.join(map(str, dummy.keys()))}) do not hold "
                      f"its main input {main!r}")
    return (None if dummy is None else decoder_started(model, dummy)), ""


def conv1d_class() -> type | None:
    """Hugging Face's ``Conv1D`` (a linear storing its weight ``[in, out]``), if transformers is loaded."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight of a linear or ``Conv1D``."""
    conv1d = conv1d_class()
    return module.weight.T if conv1d is not None and isinstance(module, conv1d) else module.weight


def layer_kind(module: nn.Module) -> str:
    """The kind a swapped-in module is listed and saved as."""
    if isinstance(module, WeightOnlyEmbeddingBag):
        return "embedding_bag"
    return "embedding" if isinstance(module, WeightOnlyEmbedding) else "linear"


def _targets(model: nn.Module, patterns: list[re.Pattern], linears: bool, embeddings: bool,
             info: WeightOnlyInfo) -> dict[str, nn.Module]:
    kinds: tuple[type, ...] = ()
    if linears:
        kinds += (nn.Linear,) + ((conv1d_class(),) if conv1d_class() else ())
    if embeddings:
        kinds += _EMBEDDINGS
    modules = dict(model.named_modules())
    return select_layers(model, kinds, patterns, info.skipped, lambda name: _renormalised(modules[name]))


def _renormalised(module: nn.Module) -> str | None:
    """Why a table whose rows ``max_norm`` rescales at each lookup stays float (its stored rows are
    not the rows it returns)."""
    if isinstance(module, _EMBEDDINGS) and module.max_norm is not None:
        return (f"max_norm={module.max_norm} renormalises the rows at each lookup, which a quantized table "
                "cannot do; leave max_norm unset to quantize it")
    return None


def own_copy(model: nn.Module) -> nn.Module:
    """qplug's copy of ``model`` to swap layers in, each computed weight (weight_norm...) baked into a
    plain one: ``copy.deepcopy`` refuses the old hook-based weight_norm, and a parametrized linear is
    a subclass the swap would skip."""
    return without_computed_weights(copy_model(model), inplace=True)[0]


def select_layers(model: nn.Module, kinds: tuple[type, ...], patterns: list[re.Pattern],
                  skipped: dict[str, str], keep_float: Callable[[str], str | None] = lambda name: None
                  ) -> dict[str, nn.Module]:
    """The modules of exactly these ``kinds`` to quantize, by name; the others' reasons go to
    ``skipped``: a subclass of a kind (its own forward, e.g. Gemma's scaled embedding, would be
    lost), a ``skip=`` pattern, a weight tied to the input embedding, ``keep_float``'s reason, or a
    weight shared with a module already taken (quantizing one copy would untie them)."""
    tied = tied_output(model)
    seen: dict[int, str] = {}
    targets = {}
    for name, module in model.named_modules():
        if not name or not isinstance(module, kinds):
            continue
        if type(module) not in kinds:
            base = next(kind for kind in kinds if isinstance(module, kind))
            skipped[name] = (f"{type(module).__name__} subclasses {base.__name__} and may compute more in its own "
                             "forward, which the quantized module would not run")
        elif any(p.fullmatch(name) for p in patterns):
            skipped[name] = "skip= matches its name"
        elif name == tied:
            skipped[name] = "its weight is tied to the input embedding"
        elif keep_float(name) is not None:
            skipped[name] = str(keep_float(name))
        elif id(module.weight) in seen:
            skipped[name] = f"its weight is shared with {seen[id(module.weight)]}"
        else:
            targets[name] = module
        seen.setdefault(id(module.weight), name)
    names = [name for name, module in model.named_modules() if name and type(module) in kinds]
    unmatched = [p.pattern for p in patterns if not any(p.fullmatch(name) for name in names)]
    if unmatched and names:
        warn_user(f"skip= pattern(s) {unmatched} match no layer: a pattern matches a whole module name "
                  f"(e.g. {names[-1]!r}; '.*{names[-1].rpartition('.')[2]}' matches every layer of that name)")
    return targets


def nothing_quantized(kinds: str, skipped: dict[str, str]) -> NothingQuantizedError:
    """The error of a module-swap flow that found no layer of ``kinds`` to swap."""
    left = "; ".join(f"{name}: {why}" for name, why in list(skipped.items())[:5])
    return NothingQuantizedError(f"nothing was quantized: no {kinds} to quantize"
                                 + (f" (left float: {left})" if left else "")
                                 + "; convolutions and other layers keep float weights here",
                                 reasons=[(why, 1) for why in skipped.values()])


def skip_patterns(skip: str | Sequence[str]) -> list[re.Pattern]:
    """``skip=`` as compiled regular expressions, or a :class:`ConfigValidationError`."""
    try:
        return [re.compile(p) for p in ([skip] if isinstance(skip, str) else skip)]
    except (re.error, TypeError) as exc:
        raise ConfigValidationError(f"skip= must be regular expressions of module names, got {skip!r} "
                                    f"({exc})", field="skip", value=skip) from exc


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.<getter>()`` (transformers' ``get_input_embeddings`` / ``get_output_embeddings``),
    or ``None`` where the model has no such method or it raises that it has none."""
    get = getattr(model, getter, None)
    if not callable(get):
        return None
    try:
        return get()
    except (NotImplementedError, AttributeError):
        return None


def output_head(model: nn.Module) -> str | None:
    """The name of the model's output head (``get_output_embeddings()``), if it has one."""
    head = _embeddings(model, "get_output_embeddings")
    return None if head is None else next((n for n, m in model.named_modules() if m is head), None)


def tied_output(model: nn.Module) -> str | None:
    """The name of an output embedding sharing its weight with the input embedding, if any."""
    first, name = _embeddings(model, "get_input_embeddings"), output_head(model)
    if first is None or name is None:
        return None
    return name if getattr(model.get_submodule(name), "weight", None) is getattr(first, "weight", False) else None


def _check_divisible(name: str, module: nn.Module, scheme: WeightOnlyScheme, embeddings: bool) -> None:
    table = isinstance(module, _EMBEDDINGS)
    features = module.embedding_dim if table else linear_weight(module).shape[1]
    size = scheme.group_size
    if size is not None and features % size:
        tables_only = " (or quantize only the tables with linears=False)" if embeddings and not table else ""
        raise ConfigValidationError(
            f"group_size {size} does not divide the {features} input features of layer {name!r}; pick a "
            + spelled(f"divisor of it or leave the layer float with skip=[{name!r}]{tables_only}",
                      "divisor of it for --group-size"),
            field="group_size", value=size)


def _quantized_module(module: nn.Module, scheme: WeightOnlyScheme, x: torch.Tensor | None,
                      algorithm: str, input_scale: torch.Tensor | None) -> nn.Module:
    """The swapped-in module of ``module`` (a linear's kernel is chosen after, by :func:`choose_kernels`);
    ``input_scale`` is AWQ's ``1 / s`` for its input."""
    if isinstance(module, nn.EmbeddingBag):
        return WeightOnlyEmbeddingBag(quantize(module.weight, scheme), module.mode, module.include_last_offset,
                                      module.padding_idx)
    if isinstance(module, nn.Embedding):
        return WeightOnlyEmbedding(quantize(module.weight, scheme), module.padding_idx)
    weight = linear_weight(module)
    if x is not None and algorithm == "gptq":
        qweight = gptq_quantize(weight, x, scheme)
    elif x is not None and input_scale is not None:
        qweight = awq_quantize(weight, x, scheme, input_scale)
    else:
        qweight = quantize(weight, scheme)
    conv1d = conv1d_class()
    return WeightOnlyLinear(qweight, module.bias, input_scale,
                            from_transposed=conv1d is not None and isinstance(module, conv1d))

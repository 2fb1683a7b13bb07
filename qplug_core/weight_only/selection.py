"""Picking the weight-only kernel for a layer: the fastest correct one on this CPU, once per process.

Candidates are the core's kernels (:data:`~qplug_core.kernels.weight_only.CORE_KERNELS`) and those
the installed backends register through the ``qplug_weight_only_kernels`` hook. For each
(scheme, weight shape, activation dtype, thread count) every candidate that supports it packs the
first layer of that shape, is checked against the float64 definition on a few rows (its relative
error within :data:`TOLERANCE`, and its gain, the part of it proportional to the output, within
:data:`MAX_GAIN`: rounding noise averages out of it, a kernel off by 1.5% everywhere does not), and is timed
at batch 1 (the decode shape, where weight-only quantization pays); the fastest correct one is
remembered for the rest of the process. A kernel that raises (in ``supports`` too), misses the
tolerance or packs to no fewer bytes than the float weight is dropped with its reason and a warning
naming it and its plugin, so a broken plugin kernel costs speed, never correctness (or memory).
Every other layer is checked too, once, when its weights are packed.

The winner is then timed against the reference (dequantize, then ``F.linear``) at 4 to 256 rows
(a prompt, an encoder's batch), and its outputs there are held to the same tolerance: where it
first loses or misses, the layer takes the reference above the last row count it won at
(:class:`~qplug_core.kernels.weight_only.RowSplitKernel`). Torch's
packed ops are decode kernels whose time grows with the rows: chosen at batch 1 alone, they ran
eight all-MiniLM-L6-v2 sentences 25x (int8) and 69x (int4) slower than float.

A kernel a file records (``qp.load``) is held to the same checks, without the timing: each layer
on the few rows, and once per weight shape on each row count of the race it serves (a kernel with
a bug at larger ``M`` on the loading host is measured again there, and said so).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qplug_core.errors import ConfigValidationError, did_you_mean, spelled, warn_user
from qplug_core.kernels.weight_only import CORE_KERNELS, ReferenceKernel, RowSplitKernel, WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight
from qplug_core.registry import plugins
from qplug_core.registry.backends import Backend, get_backend, list_backends

HOOK = "qplug_weight_only_kernels"
#: relative L2 error a kernel may add to the exact product: ORT's int8-activation path adds ~0.5%
TOLERANCE = 0.03
#: its gain (the error's projection on the exact product, relative to it) may be this far from 0:
#: rounding noise, activations rounded to int8 included, does not point along the output (ORT's
#: MatMulNBits: at most 2.7e-4 on 384 to 5632 features, 4 and 8 bits), a wrong scale does
MAX_GAIN = 2e-3
#: ... plus this many times the gain rounding noise of the size measured may show by chance (its
#: relative size over the square root of the outputs compared: 3 rows of a narrow layer are few)
_GAIN_SIGMAS = 5
_CHECK_ROWS = 3
#: output channels of a weight dequantized at once by the check
CHECK_BLOCK = 256
_TIMED_RUNS = 5
#: how far :func:`packed_bytes` looks into a packed form's containers and objects
_PACKED_DEPTH = 4
#: a chosen kernel this many times float's one-row time is said to be slower (timing noise below)
SLOWER = 1.25
#: the row counts at which the batch-1 winner is raced against dequantize-then-matmul
SPLIT_ROWS = (4, 16, 64, 256)
#: the most rows a recorded kernel is checked on at load: CPU GEMM kernels tile M by at most 64
#: (one run of ONNX Runtime's MatMulNBits on 2048 x 5632 int4: 44 ms at 64 rows, 266 ms at 256)
LOAD_CHECK_ROWS = 64

#: kernel name -> "plugin P, distribution D" for the plugins' kernels (warnings name who to tell)
_origins: dict[str, str] = {}
#: key -> (the batch-1 winner's name, the most rows it takes; None: every count measured)
_cache: dict[tuple, tuple[str, int | None]] = {}
#: (key, recorded kernel) -> why it failed the row counts it serves, '' if it passed (qp.load)
_rows_checked: dict[tuple, str] = {}
_lock = threading.Lock()


@dataclass
class Choice:
    """The kernel chosen for one key, with what each candidate measured at batch 1 (ms) or why it
    was dropped, and the batch-1 winner against the reference by rows (rows -> (winner ms,
    reference ms))."""

    kernel: WeightOnlyKernel
    timings_ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    by_rows_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: the bytes of the tensors each candidate's packed form holds (what the layer keeps in memory)
    packed_bytes: dict[str, int] = field(default_factory=dict)
    #: the candidates among ``rejected`` that are broken (raised, missed the tolerance, no smaller),
    #: not merely unsupported, or that were capped at fewer rows for missing it there
    failed: dict[str, str] = field(default_factory=dict)
    #: float ``F.linear`` on the dequantized weight at batch 1 (ms): what the quantization must beat
    float_ms: float | None = None


def available_kernels(backend: str | Backend | None = None) -> list[WeightOnlyKernel]:
    """The core's kernels and those of ``backend`` (a name or a ``Backend``; every installed,
    available backend for ``None``)."""
    names = [info.name for info in list_backends() if info.available]
    if backend is not None:
        names = [get_backend(backend).name]  # an unknown name or a wrong type: qplug's error
    kernels = list(CORE_KERNELS)
    seen = {k.name for k in kernels}
    for name in names:
        for result in plugins.collect(HOOK, backend=name):
            for kernel in result.value if result.ok else ():
                if kernel.name not in seen:
                    seen.add(kernel.name)
                    kernels.append(kernel)
                    _origins[kernel.name] = f"plugin {result.record.name}, distribution {result.record.dist}"
    return kernels


def described(kernel: WeightOnlyKernel | str) -> str:
    """``'name'`` of a kernel, with the plugin and distribution it comes from when known."""
    name = kernel if isinstance(kernel, str) else _batch_one_name(kernel)
    origin = _origins.get(name)
    return f"{name!r} ({origin})" if origin else repr(name)


def _supports(kernel: WeightOnlyKernel, weight: QuantizedWeight, dtype: torch.dtype) -> tuple[str | None, bool]:
    """(why ``kernel`` does not run ``weight`` here or ``None``, whether that is because ``supports``
    raised: a plugin's driver probe there must not break quantization)."""
    try:
        return kernel.supports(weight.scheme, weight.shape, dtype), False
    except Exception as exc:  # noqa: BLE001 - any plugin error: the kernel loses its turn
        return f"supports() raised {type(exc).__name__}: {exc}", True


def packed_bytes(packed: Any) -> int:
    """The bytes of the distinct tensors and arrays in ``packed`` (through tuples, lists, dicts and
    object attributes, a few levels deep): what a kernel keeps per layer, as far as Python sees."""
    storages: set[int] = set()
    visited: set[int] = set()
    total = 0
    stack: list[tuple[Any, int]] = [(packed, 0)]
    while stack:
        item, depth = stack.pop()
        if id(item) in visited or depth > _PACKED_DEPTH:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif hasattr(item, "nbytes") and hasattr(item, "dtype"):  # numpy arrays
            total += int(item.nbytes)
        elif isinstance(item, (tuple, list)):
            stack.extend((part, depth + 1) for part in item)
        elif isinstance(item, dict):
            stack.extend((part, depth + 1) for part in item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend((part, depth + 1) for part in vars(item).values())
    return total


def _not_smaller(size: int, weight: QuantizedWeight, dtype: torch.dtype) -> str | None:
    """Why a packed form of ``size`` bytes defeats weight-only quantization, or ``None``: no fewer
    bytes than the float weight (of ``dtype``; float32 for integer activations)."""
    float_size = weight.shape[0] * weight.shape[1] * (dtype.itemsize if dtype.is_floating_point else 4)
    if size < float_size:
        return None
    return f"packs to {size:,} bytes, no fewer than the float weight's {float_size:,}: the model would not be smaller"


def shape_of(weight: QuantizedWeight) -> str:
    """A weight's shape as messages give it, axes named: ``[out, in]`` reads as ``[in, out]`` to
    a user whose layer stores it that way (Hugging Face's ``Conv1D``)."""
    return f"[out {weight.shape[0]}, in {weight.shape[1]}]"


def output_problem(got: torch.Tensor, exact: torch.Tensor) -> str | None:
    """Why a kernel's output ``got`` is not ``exact`` (a float64 definition, or the reference
    kernel's), or ``None``: its relative L2 error beyond :data:`TOLERANCE`, or its gain beyond
    :data:`MAX_GAIN`."""
    if got.shape != exact.shape:
        return f"it returned shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    exact = exact.double()
    error, norm = got.double() - exact, exact.norm().clamp(min=1e-30)
    relative = float(error.norm() / norm)
    if not relative <= TOLERANCE:
        return f"relative error {relative:.2e} > {TOLERANCE}"
    gain = float((error * exact).sum() / norm ** 2)
    noise = float((error - gain * exact).norm() / norm)
    bound = MAX_GAIN + _GAIN_SIGMAS * noise / max(exact.numel(), 1) ** 0.5
    if not abs(gain) <= bound:
        return (f"its outputs are {gain:+.2%} off the exact product's scale (at most {bound:.2%} either way: "
                "rounding noise does not scale the outputs, a wrong scale does)")
    return None


def definition_problem(weight: QuantizedWeight, kernel: WeightOnlyKernel, packed: Any,
                       rows: int = _CHECK_ROWS) -> str | None:
    """Why ``kernel`` does not compute the float64 definition on ``rows`` seeded rows, or ``None``
    (:func:`output_problem`). Of more than 3 rows, the first, middle and last outputs are compared:
    the kernel runs its code for that many rows, and a tile it gets wrong holds one of them. The
    definition is computed :data:`CHECK_BLOCK` output channels at a time: a whole float64 weight
    (an LLM head's: 0.5 GB) made the check the peak of loading a 1.1B model's file."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator)
    got = kernel.run(packed, x, bias)
    if got.shape != (rows, weight.shape[0]):
        return f"it returned shape {tuple(got.shape)}, expected {(rows, weight.shape[0])}"
    sample = sorted({0, rows // 2, rows - 1})
    exact = torch.cat([x[sample].double() @ weight.rows(start, start + CHECK_BLOCK).dequantize(torch.float64).T
                       for start in range(0, weight.shape[0], CHECK_BLOCK)], dim=1) + bias.double()
    return output_problem(got[sample], exact)


def _time_ms(kernel: WeightOnlyKernel, packed: Any, in_features: int, give_up_ms: float) -> float:
    """Best of a few batch-1 runs; only the first when it is already slower than ``give_up_ms``."""
    x = torch.randn(1, in_features)
    start = time.perf_counter()
    kernel.run(packed, x, None)
    best = time.perf_counter() - start
    if best * 1000 > give_up_ms:
        return best * 1000
    for _ in range(_TIMED_RUNS):
        start = time.perf_counter()
        kernel.run(packed, x, None)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def _race(first: WeightOnlyKernel, first_packed: Any, second: WeightOnlyKernel, second_packed: Any,
          in_features: int, rows: int) -> tuple[float, float, str | None]:
    """Best times (ms) of two kernels on the same ``rows``, one run of each in turn: a process
    descheduled for a few ms then spoils one sample of one side, not every run of one side (run
    back to back, a ~20 us kernel's runs all fell in one time slice on a busy machine); and why
    the first's output is not the second's (:func:`output_problem`), or ``None``."""
    x = torch.randn(rows, in_features)
    best = [float("inf"), float("inf")]
    outputs: list[torch.Tensor] = [x, x]
    for _ in range(_TIMED_RUNS + 1):
        for side, (kernel, packed) in enumerate(((first, first_packed), (second, second_packed))):
            start = time.perf_counter()
            outputs[side] = kernel.run(packed, x, None)
            best[side] = min(best[side], (time.perf_counter() - start) * 1000)
    return best[0], best[1], output_problem(outputs[0], outputs[1])


def _key(weight: QuantizedWeight, dtype: torch.dtype, kernels: list[WeightOnlyKernel]) -> tuple:
    return (tuple(k.name for k in kernels), weight.scheme, weight.shape, dtype, torch.get_num_threads())


def choose(weight: QuantizedWeight, kernels: list[WeightOnlyKernel], dtype: torch.dtype = torch.float32,
           *, forced: str | None = None) -> tuple[WeightOnlyKernel, Any, Choice | None]:
    """The kernel for ``weight`` and its packed state; a fresh :class:`Choice` when this call measured.

    ``forced`` names the kernel to use (it must support the scheme and pass the check).
    """
    if forced is not None:
        return _forced(weight, kernels, dtype, forced)
    key = _key(weight, dtype, kernels)
    with _lock:
        known = _cache.get(key)
    if known is not None:
        kernel = _rebuilt(kernels, *known)
        packed = _checked_pack(kernel, weight, dtype)
        if packed is not None:
            return kernel, packed, None
    choice, packed = _measure(weight, kernels, dtype)
    with _lock:
        _cache[key] = recorded_as(choice.kernel)
    return choice.kernel, packed, choice


def recorded_as(kernel: WeightOnlyKernel) -> tuple[str, int | None]:
    """``kernel`` as plain data: its batch-1 kernel's name and the most rows it takes (``None``:
    all; the reference takes the rest)."""
    if isinstance(kernel, RowSplitKernel):
        return kernel.few.name, kernel.max_rows
    return kernel.name, None


def _rebuilt(kernels: list[WeightOnlyKernel], name: str, max_rows: int | None) -> WeightOnlyKernel:
    kernel = next(k for k in kernels if k.name == name)
    return kernel if max_rows is None else RowSplitKernel(kernel, _reference(kernels), max_rows)


def reuse(weight: QuantizedWeight, kernels: list[WeightOnlyKernel], dtype: torch.dtype, name: str,
          max_rows: int | None) -> tuple[WeightOnlyKernel, Any] | str:
    """The kernel recorded as (``name``, ``max_rows``) by :func:`recorded_as`, packed for ``weight``
    and checked like any other, or why it cannot run here. ``name`` is looked up among ``kernels``
    (the installed ones) only."""
    if name not in {k.name for k in kernels}:
        return (f"kernel {name!r} is not installed here (or not among the kernels of the backend given to "
                f"qp.load: {', '.join(k.name for k in kernels)}); install the plugin providing it to run the "
                "recorded kernel")
    kernel = _rebuilt(kernels, name, max_rows)
    reason, _ = _supports(kernel, weight, dtype)
    if reason is not None:
        return f"kernel {described(kernel)} does not run here: {reason}"
    packed = _checked_pack(kernel, weight, dtype)
    if packed is None:
        return f"kernel {name!r} failed its check here"
    key = (_key(weight, dtype, kernels), name, max_rows)
    with _lock:
        problem = _rows_checked.get(key)
    if problem is None:
        problem = _rows_problem(kernel, packed, weight)
        with _lock:
            _rows_checked[key] = problem
    return f"kernel {described(name)} failed its check here: {problem}" if problem else (kernel, packed)


def _rows_problem(kernel: WeightOnlyKernel, packed: Any, weight: QuantizedWeight) -> str:
    """Why ``kernel`` (packed) misses the definition at the most rows of :data:`SPLIT_ROWS` it
    serves, up to :data:`LOAD_CHECK_ROWS`, as the race at quantize holds it there ('' if it does
    not): a bug at larger ``M`` on this host (another CPU, another version of a plugin's runtime)
    is found at load too, at the cost of one run of that many rows and a few rows of the
    definition."""
    few, few_packed, max_rows = ((kernel.few, packed[0], kernel.max_rows) if isinstance(kernel, RowSplitKernel)
                                 else (kernel, packed, None))
    rows = max((count for count in SPLIT_ROWS if count <= min(max_rows or LOAD_CHECK_ROWS, LOAD_CHECK_ROWS)),
               default=0)
    if type(few) is ReferenceKernel or not rows:
        return ""
    try:
        problem = definition_problem(weight, few, few_packed, rows)
    except Exception as exc:  # noqa: BLE001 - a plugin kernel raising on more rows is as wrong there
        problem = f"{type(exc).__name__}: {exc}"
    return f"{problem} at {rows} rows on a {shape_of(weight)} weight" if problem else ""


def _checked_pack(kernel: WeightOnlyKernel, weight: QuantizedWeight, dtype: torch.dtype) -> Any:
    """``kernel.pack(weight)`` when it still supports this layer, reproduces the definition on it
    and is smaller than the float weight, else ``None``."""
    reason, raised = _supports(kernel, weight, dtype)
    if raised:
        warn_user(f"qplug: weight-only kernel {described(kernel)} failed on a {shape_of(weight)} weight "
                  f"({reason}); using the next fastest")
    if reason is not None:
        return None
    try:
        packed = kernel.pack(weight)
        # a split kernel runs its few-rows part on up to max_rows rows only: each part is checked
        parts = (zip((kernel.few, kernel.many), packed) if isinstance(kernel, RowSplitKernel)
                 else [(kernel, packed)])
        problem = next(filter(None, (definition_problem(weight, part, part_packed) for part, part_packed in parts)),
                       None)
    except Exception as exc:  # a plugin kernel must not break quantization: it loses its turn
        warn_user(f"qplug: weight-only kernel {described(kernel)} failed on a {shape_of(weight)} weight "
                  f"({type(exc).__name__}: {exc}); using the next fastest")
        return None
    if problem is not None:
        warn_user(f"qplug: weight-only kernel {described(kernel)} is wrong on a {shape_of(weight)} weight "
                  f"({problem}); using the next fastest")
        return None
    too_large = _not_smaller(packed_bytes(packed), weight, dtype)
    if too_large is not None:
        warn_user(f"qplug: weight-only kernel {described(kernel)} on a {shape_of(weight)} weight {too_large}; "
                  "using the next fastest")
        return None
    return packed


def _measure(weight: QuantizedWeight, kernels: list[WeightOnlyKernel],
             dtype: torch.dtype) -> tuple[Choice, Any]:
    choice = Choice(ReferenceKernel())
    best: tuple[float, WeightOnlyKernel, Any] | None = None
    # the reference last: it is the slowest, and once another kernel is timed one run shows it
    for kernel in sorted(kernels, key=lambda k: isinstance(k, ReferenceKernel)):
        reason, raised = _supports(kernel, weight, dtype)
        if reason is not None:
            choice.rejected[kernel.name] = reason
            if raised:
                choice.failed[kernel.name] = reason
            continue
        try:
            packed = kernel.pack(weight)
            size = choice.packed_bytes[kernel.name] = packed_bytes(packed)
            problem = definition_problem(weight, kernel, packed)
            if problem is not None:
                _fail(choice, kernel, problem)
                continue
            too_large = _not_smaller(size, weight, dtype)
            if too_large is not None:
                _fail(choice, kernel, too_large)
                continue
            elapsed = _time_ms(kernel, packed, weight.shape[1], 3 * best[0] if best else float("inf"))
        except Exception as exc:  # a kernel that cannot run this shape is not a candidate
            _fail(choice, kernel, f"{type(exc).__name__}: {exc}")
            continue
        choice.timings_ms[kernel.name] = elapsed
        if best is None or elapsed < best[0]:
            best = (elapsed, kernel, packed)
    if best is None:  # the reference always supports float activations
        raise ConfigValidationError(f"no weight-only kernel runs {weight.scheme} on {dtype} activations: "
                                    f"{choice.rejected}", field="scheme")
    choice.kernel = best[1]
    if dtype.is_floating_point:
        choice.float_ms = _time_ms(_FloatLinear(), weight.dequantize(dtype), weight.shape[1], 3 * best[0])
    return _split_by_rows(choice, best[2], weight, _reference(kernels), dtype)


def _fail(choice: Choice, kernel: WeightOnlyKernel, reason: str) -> None:
    choice.rejected[kernel.name] = choice.failed[kernel.name] = reason


def warn_failed(choices: list[Choice]) -> None:
    """One warning per broken kernel among ``choices`` (its first reason; the others are in
    ``choices``): a vendor learns from a user's log that a kernel of theirs was dropped."""
    first: dict[str, tuple[str, str, int]] = {}
    for choice in choices:
        for name, reason in choice.failed.items():
            what = "dropped" if name in choice.rejected else "kept for fewer rows only"
            seen = first.get(name)
            first[name] = (what, reason, 1) if seen is None else (*seen[:2], seen[2] + 1)
    for name, (what, reason, count) in first.items():
        where = "a layer shape" if count == 1 else f"{count} layer shapes"
        warn_user(f"qplug: weight-only kernel {described(name)} was {what} on {where}: {reason}"
                  + spelled("; .qplug_weight_only.choices has every reason", ""))


class _FloatLinear(WeightOnlyKernel):
    """The float model's own product, timed beside the kernels (packed: the float weight)."""

    name = "float"

    def run(self, packed, x, bias):
        return torch.nn.functional.linear(x, packed.to(x.dtype), bias)


def slower_than_float(choices: list[Choice]) -> str:
    """A warning when a chosen kernel ran one row slower than float did (the model then is smaller
    but slower: torch's packed ops are 4-12x slower than fp32 ``F.linear`` on the Intel Xeon and
    AMD EPYC CPUs measured), else ''."""
    slow = [(c.timings_ms[_batch_one_name(c.kernel)] / c.float_ms, c) for c in choices
            if c.float_ms and c.timings_ms.get(_batch_one_name(c.kernel), 0.0) > SLOWER * c.float_ms]
    if not slow:
        return ""
    ratio, worst = max(slow, key=lambda item: item[0])
    name = _batch_one_name(worst.kernel)
    core = {k.name for k in CORE_KERNELS}
    refused = "; ".join(f"{k}: {why}" for k, why in worst.rejected.items() if k not in core)
    if name not in core:  # a plugin's kernel already: small layers, where a call's fixed cost dominates
        hint = f"{name} is the fastest installed; at this layer size its fixed cost per call outweighs what it saves"
    elif refused:
        hint = f"plugin kernels installed here that were not used: {refused}"
    else:
        hint = ("a backend plugin registering faster kernels helps (qplug-onnxruntime: ONNX Runtime's "
                "MatMulNBits)")
    return (f"qplug: the fastest weight-only kernel found runs one row {ratio:.1f}x slower than float "
            f"F.linear ({name}: {worst.timings_ms[name]:.3g} ms against {worst.float_ms:.3g} ms on "
            f"{len(slow)} of {len(choices)} layer shape(s)): the model is smaller, not faster, at "
            f"decode; {hint}"
            + spelled(". .qplug_weight_only.choices has every measurement", ". qplug bench --float times the model"))


def _batch_one_name(kernel: WeightOnlyKernel) -> str:
    return kernel.few.name if isinstance(kernel, RowSplitKernel) else kernel.name


def _reference(kernels: list[WeightOnlyKernel]) -> WeightOnlyKernel:
    """The core's own reference (a plugin kernel deriving from it is a candidate like any other)."""
    return next((k for k in kernels if type(k) is ReferenceKernel), ReferenceKernel())


def _split_by_rows(choice: Choice, packed: Any, weight: QuantizedWeight, reference: WeightOnlyKernel,
                   dtype: torch.dtype) -> tuple[Choice, Any]:
    """The batch-1 winner raced against the reference at :data:`SPLIT_ROWS`: kept for every row
    count when it never loses, else split at the last count it won at. Its outputs in the race
    are held to :data:`TOLERANCE` against the reference's: a kernel wrong from some row count on
    (a tiling bug) is split below it too, and said so."""
    winner = choice.kernel
    if type(winner) is ReferenceKernel or reference.supports(weight.scheme, weight.shape, dtype):
        return choice, packed
    reference_packed = reference.pack(weight)  # the weight itself: nothing more is held
    won = 1
    for rows in SPLIT_ROWS:
        try:
            winner_ms, reference_ms, wrong = _race(winner, packed, reference, reference_packed,
                                                   weight.shape[1], rows)
            choice.by_rows_ms[rows] = (winner_ms, reference_ms)
        except Exception as exc:  # a plugin kernel raising on more rows is as wrong there
            wrong = f"{type(exc).__name__}: {exc}"
        if wrong is not None:
            choice.failed[winner.name] = f"{wrong} at {rows} rows; it runs up to {won} row(s) only"
        if wrong is not None or winner_ms > reference_ms:
            choice.kernel = RowSplitKernel(winner, reference, won)
            return choice, (packed, reference_packed)
        won = rows
    return choice, packed


def _forced(weight: QuantizedWeight, kernels: list[WeightOnlyKernel], dtype: torch.dtype,
            name: str) -> tuple[WeightOnlyKernel, Any, Choice | None]:
    by_name = {k.name: k for k in kernels}
    kernel = by_name.get(name)
    if kernel is None:
        raise ConfigValidationError(f"no weight-only kernel is called {name!r}{did_you_mean(name, by_name)}; "
                                    f"available: {', '.join(by_name)}", field="kernel", value=name)
    reason, _ = _supports(kernel, weight, dtype)
    if reason is not None:
        raise ConfigValidationError(f"weight-only kernel {name!r} cannot run {weight.scheme} for a "
                                    f"{shape_of(weight)} weight: {reason}", field="kernel", value=name)
    packed = kernel.pack(weight)
    problem = definition_problem(weight, kernel, packed)
    if problem is not None:
        raise ConfigValidationError(f"weight-only kernel {name!r} is wrong on a {shape_of(weight)} weight "
                                    f"({problem})", field="kernel", value=name)
    too_large = _not_smaller(packed_bytes(packed), weight, dtype)
    if too_large is not None:  # asked for by name: it runs, but the user hears what it costs
        warn_user(f"qplug: weight-only kernel {described(kernel)} (kernel={name!r}) on a {shape_of(weight)} weight "
                  f"{too_large}")
    return kernel, packed, None


def clear_cache() -> None:
    """Forget the measured choices (tests; a process whose CPU share changed)."""
    with _lock:
        _cache.clear()
        _rows_checked.clear()

"""``backend="auto"``: the fastest installed backend that keeps the kernel contract, measured.

No runtime wins everywhere (ONNX Runtime, OpenVINO, FBGEMM trade places per model, CPU and batch
size; at batch 1 on a small model call overhead decides), so the choice is a measurement on this
machine, not a table. The model is calibrated ONCE: ``qp.quantize`` runs for one *base* backend,
and its reference form (the :class:`~qplug_core.flows.snapshot.ReferenceSnapshot`, the same
integers and qparams for everyone) is then finished on every other candidate from its own deep
copy, so candidates share no state. The base is the candidate whose default qparams the others
accept: the narrowest weight range (symmetric [-127, 127] suits every x86 runtime, [-128, 127]
does not), then the mapping most candidates share, so those get exactly their own defaults.
A backend with ``float_outputs`` (OpenVINO for every weighted op, ONNX Runtime for linears) drops
the output grids it does not need from that reference form; where an accuracy target decides
which layers leave static int8, it measures each layer with the grids its backend keeps, so the
backends of each set of float-output kinds then get a base of their own (one more calibration
per set, only then: :func:`float_output_bases`).

Each candidate goes through the convert-time checks every backend gets (each lowered kernel,
:mod:`~qplug_core.flows.kernel_check`, and each compiled partition, :mod:`~qplug_core.flows.delegate`,
run against its reference form on the example inputs). A candidate that broke the contract
anywhere, failed to finish, or whose whole-model outputs on the example inputs are malformed or do
not point the way the reference form's do, is *rejected*: it never wins, however fast. The others
are timed on the example inputs in one interleaved measurement (every round calls each once, the
order rotating; at batch 1 on a small model each sample is the mean of calls lasting ~1 ms);
one far slower than the best after two rounds (``qnnpack`` on x86, the
reference form) is dropped early to keep the measurement short, and the report says only that it
was over :data:`DROP_RATIO` times slower (two samples on a loaded machine read 17x for 2x). When
every candidate does all its work on the calling thread and never waits (torch's kernels and
ONNX Runtime at one thread), calls are timed in CPU seconds of that thread, which the slices
other processes take do not inflate; otherwise (OpenVINO's or ONNX Runtime's own threads, a
runtime waiting on a device) in wall seconds. The fastest median wins; with an
accuracy target, the fastest of those whose search met it (a candidate's is its base's), if any.

The float model is timed in the same rounds, under the same clock, as a yardstick (never
dropped, never a reason to drop): when the winner is slower than it, a warning says so and what may
help (:mod:`~qplug_core.flows.float_baseline`); the int8 model is still returned.

The report (``qp.quantization_report(model).auto``) lists every backend tried with its median,
its SQNR against the reference form and why it won, lost or was rejected, and the float model's
median (the row :data:`~qplug_core.flows.float_baseline.BASELINE`); the ranking goes into
the saved file, and ``qp.load`` lowers to the first backend of it installed there (warning when it
is not the one measured best).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from warnings import WarningMessage

import torch
from torch import fx, nn

try:  # the calling thread's context switches (Unix): see _on_calling_thread
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

from qplug_core.errors import BackendUnavailableError, QplugError, notify, warn_user
from qplug_core.flows.final_check import output_tensors, sqnr_db
from qplug_core.flows.float_baseline import BASELINE, float_for_timing, warn_if_slower
from qplug_core.flows.kernel_check import CONTRACT_BROKEN, output_violation
from qplug_core.flows.refinish import finish_on
from qplug_core.flows.rounding_noise import MAX_NOISE_RATIO, rounding_noise
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.steps import iter_batches
from qplug_core.flows.tags import AUTO_RANKING, REPORT, TARGET
from qplug_core.registry.backends import AUTO, Backend, get_backend, list_backends

#: a candidate this many dB below the most accurate one against the reference form ...
ACCURACY_MARGIN_DB = 10.0
#: ... whose error is also beyond MAX_NOISE_RATIO times the reference form's own activation-rounding
#: noise (where that is measured, ``flows/rounding_noise.py``) is rejected: much less accurate
#: calibration batches (evenly spread) the candidates are scored on besides the example inputs
MAX_CHECK_BATCHES = 8
#: rounds of the interleaved measurement: at least, at most, and the time they may take
MIN_ROUNDS, MAX_ROUNDS, BUDGET_SECONDS = 5, 25, 2.0
#: words of the reasons a region keeps the reference form because a kernel computed wrong numbers
#: (a partition that failed to compile is only slower: its reference form is right)
_WRONG_KERNEL = (CONTRACT_BROKEN, "failed its self-test")
#: after this many rounds, a candidate this many times slower than the fastest is not timed further
DROP_AFTER, DROP_RATIO = 2, 3.0
#: each timed sample is the mean of enough back-to-back calls to last about this long (at most
#: :data:`MAX_INNER`): one 20 us call (a small CNN at batch 1) is at the mercy of the scheduler
SAMPLE_SECONDS, MAX_INNER = 1e-3, 100


@dataclass(frozen=True)
class Trial:
    """One backend tried by ``backend="auto"``: ``status`` is ``"chosen"``, ``"slower"``,
    ``"rejected"`` or ``"not tried"`` (``"baseline"`` for the float model's row); ``median_ms`` on the example inputs; ``sqnr_db`` of its
    outputs against the reference form's (the worst output, its error summed over the example
    inputs and ``sqnr_batches - 1`` calibration batches; :data:`IDENTICAL_DB` when equal);
    ``reason`` in words."""

    backend: str
    status: str
    reason: str
    median_ms: float | None = None
    sqnr_db: float | None = None
    #: the backend whose default qparams the reference form was calibrated with
    base: bool = False
    #: how many batches ``sqnr_db`` was measured on (the example inputs first)
    sqnr_batches: int = 0


def candidates() -> tuple[list[Backend], list[Trial]]:
    """The backends to try (the machine's default first) and the ones not tried, with why."""
    default = get_backend(None).name
    chosen: list[Backend] = []
    untried: list[Trial] = []
    for info in sorted(list_backends(), key=lambda info: info.name != default):
        if info.name == "reference":
            untried.append(Trial(info.name, "not tried", "simulates int8 in float (the fallback "
                                                          "when no backend keeps the contract)"))
        elif not info.available:
            untried.append(Trial(info.name, "not tried", f"{info.status}: {info.reason}"))
        elif info.name not in [b.name for b in chosen]:  # a conflict lists a name twice
            chosen.append(get_backend(info.name))
    return chosen, untried


def base_backend(backends: list[Backend]) -> Backend:
    """The candidate whose default static qparams the reference form is calibrated with (see the
    module docstring): one that quantizes every weighted output (a backend with ``float_outputs``
    drops the grids it does not need when finished, the others could not add them), then the
    narrowest weight range, then the mapping most candidates share."""
    mappings = {b.name: _default_mapping(b) for b in backends}

    def strictness(backend: Backend) -> tuple[bool, int, int]:
        mapping = mappings[backend.name]
        weight = getattr(getattr(mapping, "global_qconfig", None), "weight", None)
        kwargs = getattr(weight, "kwargs", {})
        width = int(kwargs.get("quant_max", 127)) - int(kwargs.get("quant_min", -128))
        shared = sum(mapping is not None and mapping == other for other in mappings.values())
        return len(backend.float_outputs), width, -shared

    usable = [b for b in backends if mappings[b.name] is not None] or backends
    return min(usable, key=strictness)  # min is stable: ties keep the candidates' order


def float_output_bases(backends: list[Backend], first: Backend) -> list[Backend]:
    """The further bases an accuracy target needs besides ``first`` (see the module docstring):
    one per set of float-output kinds among ``backends`` other than ``first``'s, in the
    candidates' order."""
    kinds = dict.fromkeys(b.float_outputs for b in backends if b.float_outputs != first.float_outputs)
    return [base_backend([b for b in backends if b.float_outputs == group]) for group in kinds]


def _default_mapping(backend: Backend) -> Any:
    try:
        return backend.default_qconfig_mapping("static")
    except QplugError:
        return None


def held_warnings(backend: str) -> contextlib.AbstractContextManager[list[warnings.WarningMessage]]:
    """Hold back the warnings that name ``backend`` (its kernels' and partitions': they matter
    only if it wins); every other warning reaches the user as usual when the block ends."""
    return _holding(lambda text: f"backend {backend!r}" in text)


def held_target_warnings(opening: str) -> contextlib.AbstractContextManager[list[warnings.WarningMessage]]:
    """Hold back the warnings that begin with ``opening`` (a base's accuracy target missed: it
    matters only if a backend finished from that base wins)."""
    return _holding(lambda text: text.startswith(opening))


@contextlib.contextmanager
def _holding(held_back: Callable[[str], bool]) -> Iterator[list[warnings.WarningMessage]]:
    held: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield held
    for message in caught:
        if held_back(str(message.message)):
            held.append(message)
        else:
            _reissue(message)


def _reissue(message: warnings.WarningMessage) -> None:
    # not warn_user: a held warning was given once already, through it or by torch, and keeps the
    # text and the place in the user's code it was given at
    warnings.warn_explicit(message.message, message.category, message.filename, message.lineno)


@dataclass
class Calibrated:
    """A base's converted model, its backend, and the warnings :func:`held_warnings` kept back
    while it was made; ``target_warnings``: its accuracy target's miss, if any, which holds for
    every backend finished from it."""

    model: fx.GraphModule
    backend: Backend
    warnings: list[warnings.WarningMessage] = field(default_factory=list)
    target_warnings: list[WarningMessage] = field(default_factory=list)


def _base_for(backend: Backend, bases: list[Calibrated]) -> Calibrated:
    """The base whose reference form ``backend`` is finished from: the one with its
    ``float_outputs`` kinds, else the first."""
    return next((b for b in bases if b.backend.float_outputs == backend.float_outputs), bases[0])


def choose(bases: list[Calibrated], others: list[Backend], untried: list[Trial], example_inputs: tuple,
           batches: list[tuple] | None = None, float_model: Any = None) -> fx.GraphModule:
    """Finish a base's reference form on each of ``others`` (:func:`_base_for`), check each
    candidate against its base's reference form (on the example inputs, and scored on
    ``batches`` too: :func:`check_batches`), time them all with the bases and ``float_model``
    (the yardstick: :mod:`~qplug_core.flows.float_baseline`), and return the fastest that keeps
    the contract and is not much less accurate than the others (:func:`_inaccurate`), its report
    listing the trials and the float model's time."""
    checks = [example_inputs, *(batches or [])]
    snapshots, expected, noise_db = {}, {}, {}
    for base in bases:
        snapshot = snapshot_of(base.model)
        if snapshot is None:
            raise BackendUnavailableError("backend='auto' needs a converted model with its reference form")
        snapshots[base.backend.name] = snapshot
        reference = snapshot.graph_module
        with torch.no_grad():
            expected[base.backend.name] = [reference(*inputs) for inputs in checks]
        noise_db[base.backend.name] = _rounding_db(reference, example_inputs, expected[base.backend.name][0])
    finished: dict[str, tuple[fx.GraphModule, list[warnings.WarningMessage]]] = {
        base.backend.name: (base.model, list(base.warnings)) for base in bases}
    base_of = {base.backend.name: base.backend.name for base in bases}
    trials: dict[str, Trial] = {}
    for backend in others:
        base = _base_for(backend, bases)
        base_of[backend.name] = base.backend.name
        with held_warnings(backend.name) as caught:
            try:
                model = finish_on(snapshots[base.backend.name], backend, base.model)
            except Exception as error:  # noqa: BLE001 - a candidate failing must not fail auto
                trials[backend.name] = Trial(backend.name, "rejected", f"finishing the reference "
                                             f"form failed: {type(error).__name__}: {error}")
                continue
        finished[backend.name] = (model, caught)
    for name, (model, _) in list(finished.items()):
        problem, sqnr = _problem(model, checks, expected[base_of[name]])
        if problem:
            trials[name] = Trial(name, "rejected", problem, sqnr_db=sqnr, sqnr_batches=len(checks))
            del finished[name]
        else:
            trials[name] = Trial(name, "timed", "", sqnr_db=sqnr, sqnr_batches=len(checks))
    for name, why in _inaccurate(trials, {name: noise_db[base_of[name]] for name in finished}).items():
        trials[name] = dataclasses.replace(trials[name], status="rejected", reason=why)
        del finished[name]
    trials = {name: dataclasses.replace(t, base=base_of.get(name) == name) for name, t in trials.items()}
    if not finished:
        first = bases[0]
        fallback = finish_on(snapshots[first.backend.name], get_backend("reference"), first.model)
        warn_user("qplug: backend='auto': no installed backend kept the kernel contract on this "
                  "model; it runs in reference form (see the report's auto section)")
        return _record(fallback, [*trials.values(), *untried], ["reference"])
    timed: dict[str, Callable] = {name: model for name, (model, _) in finished.items()}
    with float_for_timing(float_model, example_inputs) as (yardstick, not_timed):
        if yardstick is not None:
            timed[BASELINE] = yardstick
        medians, dropped, on_thread = measure(timed, example_inputs,
                                              baseline=BASELINE if yardstick is not None else None)
    float_median = medians.pop(BASELINE, None)
    misses = {name: _target_misses(model) for name, (model, _) in finished.items()}
    # with an accuracy target, the backends whose search met it first: the user asked for it
    ranking = sorted(medians, key=lambda name: (bool(misses[name]), medians[name]))
    winner = ranking[0]
    peers = [name for name in ranking if bool(misses[name]) == bool(misses[winner])]
    for name in finished:
        trial = dataclasses.replace(trials[name], median_ms=medians[name] * 1e3)
        if name == winner:
            runner_up = next(iter(peers[1:]), None)
            why = (f"fastest of {len(peers)} that kept the contract"
                   + (" and met the accuracy target" if len(peers) < len(ranking) else "")
                   + (f", over {DROP_RATIO:g}x faster than {runner_up} (not timed further)"
                      if runner_up in dropped else
                      f", {medians[runner_up] / medians[name]:.2f}x faster than {runner_up}" if runner_up else "")
                   + ("; timed in CPU time of the calling thread, where every backend ran" if on_thread else "")
                   + (f"; no backend met the accuracy target ({misses[name]})" if misses[name] else ""))
            trials[name] = dataclasses.replace(trial, status="chosen", reason=why)
        elif misses[name] and not misses[winner]:
            trials[name] = dataclasses.replace(trial, status="slower", reason=(
                f"missed the accuracy target ({misses[name]}), which {winner} met; "
                f"{medians[name] / medians[winner]:.2f}x the chosen backend's time"))
        else:
            trials[name] = dataclasses.replace(trial, status="slower", reason=(
                f"over {DROP_RATIO:g}x the fastest in the first {DROP_AFTER} rounds (best call each): "
                "not timed further"
                if name in dropped else f"{medians[name] / medians[winner]:.2f}x the fastest"))
    winner_base = next(base for base in bases if base.backend.name == base_of[winner])
    for message in [*winner_base.target_warnings, *finished[winner][1]]:  # the winner's reach the user
        _reissue(message)
    notify(f"backend='auto' chose {winner!r} ({trials[winner].reason}; qp.quantization_report "
           "lists every backend tried)")
    if float_median is not None:
        ratio = medians[winner] / float_median
        trials[BASELINE] = Trial(BASELINE, "baseline", f"the float model, timed in the same rounds: "
                                 f"{winner} runs at {ratio:.2f}x its time", median_ms=float_median * 1e3)
        warn_if_slower(winner, ratio, float_model, example_inputs)
    elif float_model is not None:
        trials[BASELINE] = Trial(BASELINE, "baseline", not_timed)
    order = {"chosen": 0, "baseline": 1, "slower": 2, "rejected": 3, "not tried": 4}
    listed = sorted(trials.values(), key=lambda t: (order[t.status], t.median_ms or 0.0))
    # a file holds the winner's reference form: only the backends measured on that one run it as
    # measured (one finished from another base, e.g. qnnpack beside onnxruntime's float-output
    # form, left every linear in reference form when qp.load fell back to it)
    same_form = [name for name in ranking if base_of[name] == base_of[winner]]
    return _record(finished[winner][0], [*listed, *untried], same_form)


def _target_misses(model: fx.GraphModule) -> str:
    """What ``model``'s accuracy target search missed, in words ('' if it met it or had none)."""
    result = model.meta.get(TARGET)
    if result is None or result.met:
        return ""
    return "; ".join(result.target.misses(result.final))


def _problem(model: nn.Module, checks: list[tuple], expected: list) -> tuple[str, float | None]:
    """Why ``model`` must not be chosen ('' if it may), and its SQNR against the reference form
    (``expected``: its outputs on each of ``checks``, the example inputs first)."""
    report = model.meta.get(REPORT) if isinstance(model, fx.GraphModule) else None
    broken = [reason for reason in getattr(report, "reference", {}).values()
              if any(marker in reason for marker in _WRONG_KERNEL)]
    energy: dict[int, list[float]] = {}  # output -> [signal, noise] summed over the batches
    for batch, (inputs, reference) in enumerate(zip(checks, expected)):
        where = "the example inputs" if batch == 0 else f"calibration batch {batch - 1} of those kept"
        try:
            with torch.no_grad():
                got = model(*inputs)
        except Exception as error:  # noqa: BLE001 - a candidate that raises is not a candidate
            return f"it raised {type(error).__name__} on {where}: {error}", None
        outputs, references = output_tensors(got), output_tensors(reference)
        if len(outputs) != len(references):
            return f"it returned {len(outputs)} outputs, the reference form {len(references)}", None
        for i, (out, ref) in enumerate(zip(outputs, references)):
            problem = output_violation(out, ref, ref.dtype, None, max_outlier_fraction=1.0)
            if not problem and ref.is_floating_point() and ref.numel():
                cosine = float(torch.nn.functional.cosine_similarity(
                    out.double().flatten(), ref.double().flatten(), dim=0))
                if bool(ref.any()) and not cosine > 0:
                    problem = f"its outputs point away from the reference form's (cosine {cosine:.2f})"
                sums = energy.setdefault(i, [0.0, 0.0])
                sums[0] += float(ref.double().pow(2).sum())
                sums[1] += float((out.double() - ref.double()).pow(2).sum())
            if problem:
                return f"output {i}" + (f" on {where}" if batch else "") + f": {problem}", None
    sqnr = min(sqnr_db(signal, noise) for signal, noise in energy.values()) if energy else None
    if broken:
        return (f"{len(broken)} region(s) kept the reference form because its kernels or "
                f"partitions broke the kernel contract: {broken[0]}"), sqnr
    return "", sqnr


def _rounding_db(reference: fx.GraphModule, inputs: tuple, expected: Any) -> float | None:
    """The reference form's SQNR against itself run without activation rounding (its worst float
    output, on ``inputs``): its own quantization noise; None where that cannot be run."""
    outputs = list(expected) if isinstance(expected, (tuple, list)) else [expected]  # as rounding_noise reads its own
    noise = rounding_noise(reference, inputs, outputs)
    measured = [sqnr_db(float(ref.double().pow(2).sum()), n * n) for ref, n in zip(outputs, noise) if n is not None]
    return min(measured) if measured else None


def _inaccurate(trials: dict[str, Trial], noise_db: dict[str, float | None]) -> dict[str, str]:
    """The candidates still in the running (``noise_db``: each one's reference form's own
    rounding SQNR) that are much less accurate than the most accurate of them, with why: more
    than :data:`ACCURACY_MARGIN_DB` below it against the reference form and, where the reference
    form's own noise is measured, an error beyond :data:`MAX_NOISE_RATIO` times that noise. A
    runtime rounding otherwise than the reference form stays within both; a compile that loses
    20 dB (OpenVINO's UNet concat with symbolic sizes) does not."""
    # the reference backend runs the reference form itself: identical by definition, it is no
    # yardstick for runtimes, which all round otherwise
    scored = {name: db for name in noise_db if (db := trials[name].sqnr_db) is not None and name != "reference"}
    if not scored:
        return {}
    best = max(scored, key=scored.__getitem__)
    allowance = 20 * math.log10(MAX_NOISE_RATIO)
    inaccurate = {}
    for name, db in scored.items():
        own = noise_db[name]
        if db < scored[best] - ACCURACY_MARGIN_DB and (own is None or db < own - allowance):
            inaccurate[name] = (
                f"much less accurate: {db:.1f} dB against the reference form, {scored[best] - db:.1f} dB "
                f"below {best} (at most {ACCURACY_MARGIN_DB:g})"
                + ("" if own is None else f", beyond {MAX_NOISE_RATIO:g}x the reference form's own "
                   f"activation-rounding noise ({own:.1f} dB)"))
    return inaccurate


def check_batches(calibration_data: Any, model: nn.Module) -> list[tuple]:
    """Up to :data:`MAX_CHECK_BATCHES` calibration batches, evenly spread, the candidates are
    scored on besides the example inputs: read again from a list or tuple; none from a one-pass
    iterable (a generator; a DataLoader, which would load its data once more), which calibration
    read already."""
    if not isinstance(calibration_data, (list, tuple)):
        return []
    stride = max(1, math.ceil(len(calibration_data) / MAX_CHECK_BATCHES))
    return list(iter_batches(calibration_data[::stride], model))


def measure(models: dict[str, Callable], inputs: tuple, baseline: str | None = None
            ) -> tuple[dict[str, float], set[str], bool]:
    """Median seconds per call of each model on ``inputs``, interleaved (each round calls every
    model once, the order rotating); the names dropped for being more than :data:`DROP_RATIO`
    times slower than the fastest after :data:`DROP_AFTER` rounds (their best sample stands for
    their median); and whether calls were timed in CPU seconds of the calling thread
    (:func:`_on_calling_thread` of every model), not wall seconds. The model named ``baseline``
    is a yardstick: timed in every round, never dropped, and no candidate is dropped for it."""
    names = list(models)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        warm = {}
        for name in names:  # warm-up: first calls allocate, compile lazily, fill caches
            models[name](*inputs)
            t0 = time.perf_counter()
            models[name](*inputs)
            warm[name] = time.perf_counter() - t0
        on_thread = all(_on_calling_thread(models[name], inputs) for name in names)
        clock = time.thread_time if on_thread else time.perf_counter
        # the candidates' speed sets it: a fast yardstick must not multiply a slow candidate's calls
        quickest = min(seconds for name, seconds in warm.items() if name != baseline)
        inner = max(1, min(MAX_INNER, int(SAMPLE_SECONDS / max(quickest, 1e-9))))
        started = time.perf_counter()
        rounds = 0
        active = names
        while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS
                                      and time.perf_counter() - started < BUDGET_SECONDS):
            for name in active[rounds % len(active):] + active[:rounds % len(active)]:
                model = models[name]
                t0 = clock()
                for _ in range(inner):
                    model(*inputs)
                samples[name].append((clock() - t0) / inner)
            rounds += 1
            if rounds == DROP_AFTER:
                fastest = {name: min(samples[name]) for name in active if name != baseline}
                best = min(fastest.values())
                active = [name for name in active if name == baseline or fastest[name] <= DROP_RATIO * best]
    medians = {name: sorted(times)[len(times) // 2] if name in active else min(times)
               for name, times in samples.items()}
    return medians, set(names) - set(active), on_thread


def _on_calling_thread(model: Callable, inputs: tuple) -> bool:
    """Whether one call of ``model`` did all its work on the calling thread and never waited: no
    voluntary context switch of the thread (a sleep, a lock, worker threads to join) and no CPU time
    spent by the process's other threads. Its thread's CPU time is then its wall time minus the
    slices other processes took (where the OS cannot tell: False, and wall time is used)."""
    if resource is None or not hasattr(resource, "RUSAGE_THREAD"):
        return False
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    thread, process = time.thread_time(), time.process_time()
    model(*inputs)
    thread, process = time.thread_time() - thread, time.process_time() - process
    waited = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches
    return waited == 0 and process <= 1.1 * thread + 1e-4


def _record(model: fx.GraphModule, trials: list[Trial], ranking: list[str]) -> fx.GraphModule:
    model.meta[REPORT].auto = [dataclasses.asdict(t) for t in trials]
    model.meta[AUTO_RANKING] = tuple(ranking)
    return model


__all__ = ["AUTO", "Trial", "base_backend", "candidates", "check_batches", "choose", "finish_on", "measure"]

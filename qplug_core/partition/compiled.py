"""``CompiledPartition``: the module a compiling backend's delegate puts in place of a partition.

Every runtime that compiles a serialized model (ONNX Runtime sessions, OpenVINO compiled models,
an NPU SDK) needs the same bookkeeping around its own two steps: the reference-form partition kept
outside the module tree (to serialize it for another input shape), the compiled models and the
input signatures each serves (one each, or many where the serialized model has symbolic sizes:
:meth:`serves`), the serialized model each was built from (:attr:`~CompiledPartition.sources`:
what :meth:`recompile` builds again after a change of settings and ``qp.save`` stores, instead of
an export each time, ~14 s CPU for MobileNetV2; up to :data:`SOURCE_BYTES_IN_MEMORY` of them in
memory across the process, the others in temporary files, so that a large model's weights, or those
of many partitions or signatures, are not held once more in RAM; where a file cannot be written
either, none: the partition runs, and a rebuild or ``qp.save`` exports again), the
output structure (tensor or tuple), a deep copy that runs the same compiled models (:meth:`shared`:
compiling them again cost one export and one compile per signature, and a second copy of their
weights) and shares their sources. A subclass gives :meth:`build` (serialized model -> the
runtime's compiled form) and :meth:`run` (compiled form, inputs -> output tensors).

Models compiled for one signature each are kept up to :attr:`~CompiledPartition.shape_cache_size`
(8 by default, the plugins' ``configure(shape_cache_size=...)``), least recently used first out:
a server meeting many shapes the graph fixes (a symbolic size serves all of them with one model)
frees the models it no longer calls instead of holding one per shape forever; a warning says so
once.

A model compiled for a new input signature (batch 1 after a batch-256 example) is held to the
contract the first one was held to at convert: built under the same error handling, run once on
the inputs that asked for it and compared with the reference form (the pipeline's
:class:`SignatureCheck`). One that fails either way is dropped, and that signature runs the
reference form from then on, with one warning: a runtime may fail or compute otherwise at one size
only (OpenVINO compiles Mish at batch 256 but not at batch 1, and gave an unbatched row a batch axis).
A compiled model that raises on a call once the pipeline holds the partition to the contract (a
runtime failing at one size, or on some values, after its model was built) is treated the same:
the call is answered by the reference form and that signature runs it from then on, with one
warning (:func:`reference_answer`; where the reference form cannot take the inputs either, the
pipeline's error names the plugin and the partition).
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import fx, nn

from qplug_core.errors import ExportError, InputMismatchError, QplugError, warn_user
from qplug_core.ir.failed_calls import quiet_call
from qplug_core.ir.tracing import refuse_tracing, run_eagerly, warn_state_dict_incomplete
from qplug_core.partition.denormals import call_flushing_denormals
from qplug_core.partition.held import HoldsPartition
from qplug_core.partition.id_bounds import IdBounds
from qplug_core.partition.source_file import InMemory, kept_file

#: a serialized partition: bytes, or a file (with its external data) for a large one
Source = bytes | os.PathLike
#: the route of an input signature whose compiled model was refused: it runs the reference form
REFERENCE_FORM = ("reference form",)
#: serialized bytes the compiled partitions of the process keep in memory for their models; a source
#: past it is kept in a temporary file (patched lower by tests)
SOURCE_BYTES_IN_MEMORY = 2**23
#: serialized models the next partition built in this context compiles instead of serializing
#: its partition for those signatures (:func:`built_from`), taken by its first compile
_PRESET: ContextVar[list[tuple[tuple, Source]] | None] = ContextVar("preset_sources", default=None)


@contextmanager
def built_from(sources: Sequence[tuple[tuple, Source]]) -> Iterator[None]:
    """The :class:`CompiledPartition` built in this block starts from ``sources`` (input
    signature, serialized model for it: what ``qp.save`` stored, checked at load) instead of
    serializing its partition (an export: seconds, and torch.onnx imported): its first compile
    builds each of them; inputs none of them serves are compiled as always."""
    token = _PRESET.set(list(sources))
    try:
        yield
    finally:
        _PRESET.reset(token)


class SignatureCheck(Protocol):
    """How a model compiled for a new input signature is held to the convert-time contract (set by
    the pipeline, which knows the contract and the report: ``flows/delegate.py``)."""

    def problem(self, reference: fx.GraphModule, candidate: Callable[..., Any], inputs: tuple) -> str:
        """Why ``candidate`` (the new model, run like the partition) may not serve ``inputs``:
        '' if it may."""

    def refused(self, signature: str, reason: str) -> None:
        """Say (a warning, the report) that inputs of ``signature`` run the reference form, and why."""

    def failed(self, signature: str, error: Exception, again: Exception) -> Exception:
        """The error to raise where the compiled model raised ``error`` on inputs of ``signature``
        and the reference form raised ``again`` on them too."""


def input_signature(inputs) -> tuple:
    """The shapes and dtypes of ``inputs``, hashable: what a compiled model is built for."""
    if len(inputs) == 1:  # no comprehension frame: ~0.3 us at batch 1
        return ((inputs[0].shape, inputs[0].dtype),)
    return tuple([(t.shape, t.dtype) for t in inputs])  # torch.Size is a tuple: hashable


def described_signature(signature: tuple) -> str:
    return ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in signature)


def reference_answer(reference: Callable[..., Any], inputs: tuple, error: Exception, check: SignatureCheck) -> Any:
    """``reference``'s outputs for ``inputs``, on which a compiled model raised ``error``; where
    the reference form cannot take them either, the inputs are wrong: ``check``'s error, from
    ``error``."""
    try:
        return quiet_call(reference, inputs)
    except Exception as again:
        raise check.failed(described_signature(input_signature(inputs)), error, again) from error


def failure_reason(error: Exception) -> str:
    """Why a signature runs the reference form after its compiled model raised ``error``."""
    return f"its compiled model raised {type(error).__name__}: {' '.join(str(error).split())[:300]}"


class CompiledPartition(HoldsPartition, nn.Module):
    """Runs one partition in a runtime; ``serialize(partition, inputs)`` gives the bytes (or the
    file) :meth:`build` compiles (e.g. ``plugin_api.onnx_source(plugin_api.to_onnx_proto(...))``)."""

    #: run with denormal floats flushed to zero on the calling thread (values below float32's
    #: normal range, zero on any int8 grid and slow to compute: ``partition/denormals.py``); the
    #: runtime's own worker threads are the subclass's to set
    flush_denormals = True
    #: checks the models compiled for new signatures (None: only their build failures fall back)
    signature_check: SignatureCheck | None
    #: compiled models kept at most, least recently used first out (the plugins set it from
    #: their ``configure(shape_cache_size=...)``)
    shape_cache_size = 8
    #: whether it starts from the models :func:`built_from` handed it (not one compiled here); inputs
    #: none of them serves are compiled at their first call, as a new signature (held to the
    #: contract, the reference form where that fails), not at construction (where a failure raises)
    from_stored = False

    def __init__(self, partition: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 serialize: Callable[[fx.GraphModule, tuple], Source]):
        super().__init__()
        self.__dict__["_partition"] = partition  # not a submodule: it is not part of the state
        self._serialize = serialize
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._sources: dict[tuple, Source] = {}  # signature compiled for -> the source it was built from
        self.__dict__["_in_memory"] = InMemory()  # the bytes of _sources, against SOURCE_BYTES_IN_MEMORY
        self._routes: dict[tuple, tuple] = {}  # input signature -> the signature compiled for it
        self._single_output = True
        self.__dict__["_routing"] = threading.Lock()
        self.__dict__["signature_check"] = None
        self.refused: dict[str, str] = {}  # input signature -> why it runs the reference form
        self.__dict__["_id_bounds"] = IdBounds.of(partition)  # a runtime takes ids a table refuses
        if not self._build_stored(example_inputs):
            self._compile(example_inputs)

    def build(self, source: Source) -> Any:
        """The runtime's compiled form of one serialized partition (with the settings in force):
        bytes, or a path to a file with its external data (``plugin_api.onnx_source`` hands a
        large model over so), removed once this returns."""
        raise NotImplementedError

    def run(self, compiled: Any, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The partition's outputs for ``inputs``, computed by ``compiled``."""
        raise NotImplementedError

    def serves(self, compiled: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``compiled`` (built for other shapes) computes this partition for ``inputs``
        too: a runtime whose compiled models take symbolic sizes says so here. Default: no, each
        input signature gets a model of its own."""
        return False

    def shared(self, compiled: Any) -> Any:
        """What a deep copy runs for ``compiled``: ``compiled`` itself by default, for a runtime
        whose compiled model takes calls from several threads at once (ONNX Runtime's
        ``InferenceSession.run`` is thread-safe); a subclass whose compiled form holds state of
        one caller (OpenVINO's infer request) gives the copy its own around the same model."""
        return compiled

    def runtime(self) -> tuple[str, str] | None:
        """The runtime that builds and runs the compiled models and its version (``("onnxruntime",
        "1.23.2")``): ``qp.save`` records it beside the models it stores, and a first call after
        ``qp.load`` under another version holds them to the contract again. Default: None (not
        said; stored models are run as the file's CPU class allows)."""
        return None

    def runtime_int8(self) -> list[torch.Tensor]:
        """int8 tensors the runtime keeps for its compiled models as they are (views of its own
        memory, never written): a reference form held with int8 weights takes the ones equal to
        its own from here instead of keeping a copy (``flows/held_forms.py``). Default: none."""
        return []

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        warn_state_dict_incomplete(destination)  # its weights are in the runtime's compiled form

    @staticmethod
    def as_array(tensor: torch.Tensor) -> Any:
        """A numpy view of ``tensor``'s buffer for the runtime (a contiguous copy first if it is
        not contiguous); ``detach`` only when it requires grad: it costs a microsecond per call."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        return tensor.contiguous().numpy()

    _signature = staticmethod(input_signature)

    @torch.autocast("cpu", enabled=False)  # a first call under the caller's autocast: export in float32
    def _compile(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        partition = self.partition
        signature = self._signature(inputs)
        # the output structure (tensor or tuple) the partition returns
        self._single_output = isinstance(self._checked(inputs), torch.Tensor)
        source = self._serialize(partition, inputs)
        self._evict(len(self._compiled) + 1 - self.shape_cache_size)
        try:
            compiled = self.build(self._keep(signature, source))
        except BaseException:
            self._forget(signature)
            raise
        self._compiled[signature] = compiled  # after its source: `sources` reads both
        self._routes[signature] = signature
        return compiled

    def _build_stored(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Build the models :func:`built_from` hands this partition (once: they are taken) and route
        ``inputs`` to the one that serves them; whether there were any. Inputs none serves (batch 1
        where the stored model's batch is symbolic from 2) are left to their first call: compiled
        there as a new signature, a failure runs the reference form as it does in memory."""
        preset = _PRESET.get()
        if not preset:
            return False
        stored = preset[:self.shape_cache_size]
        preset.clear()
        signature = self._signature(inputs)
        for compiled_for, stored_source in stored:
            try:
                self._compiled[compiled_for] = compiled = self.build(self._keep(compiled_for, stored_source))
            except BaseException:
                self._forget(compiled_for)
                raise
            self._routes[compiled_for] = compiled_for
            if signature not in self._routes and self.serves(compiled, inputs):
                self._routes[signature] = compiled_for
        # the output structure from the graph: running the reference form imports torch._dynamo
        # (its custom ops' first call), ~2 s and ~70 MiB
        self._single_output = isinstance(_output_node(self.partition).args[0], fx.Node)
        self.from_stored = True
        return True

    def _evict(self, count: int) -> None:
        """Let go of the ``count`` least recently used compiled models (and the routes to them)."""
        if count <= 0:
            return
        if "_evicted" not in self.__dict__:
            self.__dict__["_evicted"] = True
            warn_user(f"qplug: {type(self).__name__}: more than {self.shape_cache_size} input shapes need a "
                      "model compiled for each (the graph fixes their sizes); the least recently used are "
                      "freed and compiled again when called again: warm up the shapes you serve, or raise "
                      "the plugin's configure(shape_cache_size=...)")
        for _ in range(count):
            gone, _ = self._compiled.popitem(last=False)
            self._forget(gone)
            self._routes = {s: r for s, r in self._routes.items() if r != gone}

    def _checked(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        """The partition's output for ``inputs`` (before a model is compiled for them, and when a
        compiled model failed on them), or :class:`InputMismatchError` for inputs its layers
        cannot take."""
        try:
            with torch.no_grad():
                return quiet_call(self.partition, inputs)
        except (RuntimeError, IndexError) as exc:  # the caller's inputs (ids of rank 1), not the runtime's fault
            raise InputMismatchError(f"{type(self).__name__} cannot take inputs {self._mismatch(inputs)} "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc

    def _mismatch(self, inputs: tuple[torch.Tensor, ...]) -> str:
        """What the refused ``inputs`` differ in from the first ones compiled (the example inputs at
        convert): their shapes, their dtypes or both; either when nothing was compiled yet (a loaded
        model's first call)."""
        given = self._signature(inputs)
        shapes = ", ".join(str(tuple(shape)) for shape, _ in given)
        dtypes = ", ".join(str(dtype).removeprefix("torch.") for _, dtype in given)
        compiled = next(iter(self._compiled), None)
        if compiled is None or len(compiled) != len(given):
            return (f"of shape {shapes}: the model's inputs do not have the shape or dtype ({dtypes}) it was "
                    "quantized for")
        if [shape for shape, _ in compiled] == [shape for shape, _ in given]:
            wanted = ", ".join(str(dtype).removeprefix("torch.") for _, dtype in compiled)
            return (f"of dtype {dtypes} where it was compiled for {wanted} (the shapes are the same): the "
                    "model's inputs do not have the dtype it was quantized for")
        if [dtype for _, dtype in compiled] == [dtype for _, dtype in given]:
            return f"of shape {shapes}: the model's inputs do not have the shape it was quantized for"
        return (f"of shape {shapes} and dtype {dtypes}: the model's inputs have neither the shape nor the "
                "dtype it was quantized for")

    @run_eagerly  # under torch.compile, dynamo must not trace the exporter it calls
    def _route(self, inputs: tuple[torch.Tensor, ...]) -> tuple:
        """The route (a compiled model's signature, or :data:`REFERENCE_FORM`) for a signature not
        seen yet: a model built before that serves it, or a new one. One thread at a time: a
        server's threads meeting a new batch size together compiled it once each, racing in torch's
        exporter."""
        signature = self._signature(inputs)
        with self._routing:
            route = self._routes.get(signature)
            if route is not None:  # another thread compiled it meanwhile
                return route
            for compiled_for, compiled in self._compiled.items():
                if self.serves(compiled, inputs):
                    self._routes[signature] = compiled_for
                    return compiled_for
            reason = self._admit(inputs)
            if reason:
                self._compiled.pop(signature, None)
                self._forget(signature)
                self.__dict__["_reference_form"] = self.partition  # runs it from now on: built once
                self._routes[signature] = REFERENCE_FORM
                self.refused[self._described(signature)] = reason
                check = self.signature_check
                if check is None:
                    warn_user(f"qplug: {type(self).__name__}: inputs {self._described(signature)} run the "
                              f"partition's reference form: {reason}")
                else:
                    check.refused(self._described(signature), reason)
            return self._routes[signature]

    def _admit(self, inputs: tuple[torch.Tensor, ...]) -> str:
        """Compile a model for ``inputs`` and check it: why it may not serve them ('' if it may)."""
        try:
            compiled = self._compile(inputs)
            check = self.signature_check
            if check is None:
                return ""
            return check.problem(self.partition, lambda *xs: self._call(compiled, xs), inputs)
        except InputMismatchError:
            raise  # the caller's inputs, not the runtime
        except Exception as exc:  # noqa: BLE001 - a runtime failing at one size falls back, as at convert
            return f"compiling it failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"

    _described = staticmethod(described_signature)

    def _keep(self, signature: tuple, source: Source) -> Source:
        """Keep ``source`` as ``signature``'s and return it as kept: in a file of its own where the
        bytes kept in memory would pass :data:`SOURCE_BYTES_IN_MEMORY` (the runtime holds the weights
        already); not at all where the file cannot be written (a full ``/tmp``: one warning), so
        that a rebuild or ``qp.save`` exports it again, rather than losing the runtime's model."""
        if isinstance(source, bytes) and not self._in_memory.take(len(source), SOURCE_BYTES_IN_MEMORY):
            try:
                source = kept_file(source)
            except ExportError as exc:
                if "_unkept" not in self.__dict__:
                    self.__dict__["_unkept"] = True
                    warn_user(f"qplug: {type(self).__name__}: {exc}; the partition runs without it, and is "
                              "exported again where it is rebuilt or saved (set TMPDIR to a disk with room)")
                return source
        self._sources[signature] = source
        return source

    def _forget(self, signature: tuple) -> None:
        """Let go of ``signature``'s kept source (its bytes no longer count against the budget)."""
        source = self._sources.pop(signature, None)
        if isinstance(source, bytes):
            self._in_memory.give(len(source))

    def _source(self, signature: tuple) -> Source:
        """``signature``'s kept source, or the partition serialized again for it where none was kept."""
        source = self._sources.get(signature)
        if source is None:
            source = self._serialize(self.partition, tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in signature))
        return source

    def recompile(self) -> None:
        """Build every compiled model again (after a change of settings) from the source it was
        built from: no export (but where no source could be kept)."""
        with self._routing:
            self._compiled = OrderedDict((signature, self.build(self._source(signature))) for signature in self._compiled)

    def kept_sources(self) -> list[tuple[tuple, Source]]:
        """(input signature, serialized model) of each signature compiled so far (one snapshot), in
        the order of :attr:`signatures`: bytes, or a file (a large model); one whose source could
        not be kept is serialized again."""
        with self._routing:
            signatures = list(self._compiled)
            return [(signature, self._source(signature)) for signature in signatures]

    @property
    def sources(self) -> list[Source]:
        """The serialized model of each input signature compiled so far, in the order of
        :attr:`signatures` (:meth:`kept_sources`)."""
        return [source for _, source in self.kept_sources()]

    @property
    def signatures(self) -> list[tuple]:
        """The input signatures compiled for so far, in the order of :attr:`sources`."""
        with self._routing:
            return list(self._compiled)

    @property
    def compiled(self) -> list[Any]:
        """The compiled forms built so far (one per signature they were built for)."""
        return list(self._compiled.values())

    def forward(self, *inputs: torch.Tensor):
        # at batch 1 on a small model the runtime takes ~15 us: every microsecond here counts
        if torch.jit.is_tracing() or torch.compiler.is_exporting():
            refuse_tracing(f"a partition compiled by {type(self).__name__}", inputs)
        signature = self._signature(inputs)
        id_bounds = self.__dict__.get("_id_bounds")
        if id_bounds is not None:
            id_bounds.check(inputs, signature)
        route = self._routes.get(signature)
        if route is None:
            if any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in inputs):
                return self.partition(*inputs)  # an empty batch: OpenVINO refuses to compile size 0
            route = self._route(inputs)
        if route is REFERENCE_FORM:
            return self.__dict__["_reference_form"](*inputs)
        compiled = self._compiled.get(route)
        if compiled is None:  # freed by another thread's new shape meanwhile
            return self.forward(*inputs)
        if len(self._compiled) > 1:
            self._compiled.move_to_end(route)  # C OrderedDict: atomic under the GIL
        try:
            return self._call(compiled, inputs)
        except QplugError:
            raise
        except Exception as error:
            if self.signature_check is None:  # not served by the pipeline (yet: convert checks it)
                # a symbolic size may take shapes the layers do not (a linear after a flatten): the
                # caller's inputs, said as such, rather than the runtime's raw error
                self._checked(inputs)
                raise
            return self._answer_by_reference(inputs, error, self.signature_check)

    def _answer_by_reference(self, inputs: tuple[torch.Tensor, ...], error: Exception,
                             check: SignatureCheck) -> Any:
        """The reference form's outputs for ``inputs``, on which the compiled model raised; inputs
        of that signature run it from now on, and ``check`` says so once."""
        reference = self.__dict__.get("_reference_form") or self.partition
        outputs = reference_answer(reference, inputs, error, check)
        signature, reason = self._signature(inputs), failure_reason(error)
        with self._routing:
            self.__dict__["_reference_form"] = reference
            first = self._routes.get(signature) is not REFERENCE_FORM
            self._routes[signature] = REFERENCE_FORM
            self.refused[self._described(signature)] = reason
        if first:
            check.refused(self._described(signature), reason)
        return outputs

    def _call(self, compiled: Any, inputs: tuple[torch.Tensor, ...]):
        """``compiled``'s outputs for ``inputs``, structured as the partition's."""
        if self.flush_denormals:
            outputs = call_flushing_denormals(self.run, compiled, inputs)
        else:
            outputs = self.run(compiled, inputs)
        return outputs[0] if self._single_output else tuple(outputs)

    def __deepcopy__(self, memo: dict) -> CompiledPartition:
        """The copy runs the same compiled models (:meth:`shared`, built from the same sources) beside
        its own copy of the partition; what a user changes is its own (settings and :meth:`recompile`, models compiled
        for new signatures, refusals)."""
        clone = type(self).__new__(type(self))
        nn.Module.__init__(clone)
        for key, value in self.__dict__.items():
            clone.__dict__.setdefault(key, value)  # settings and the like (nn.Module's own are fresh)
        clone.training = self.training
        clone.__dict__["_routing"] = threading.Lock()
        clone.refused = dict(self.refused)
        clone.__dict__["_partition"] = copy.deepcopy(self.form, memo)
        if "_reference_form" in self.__dict__:
            clone.__dict__["_reference_form"] = copy.deepcopy(self.__dict__["_reference_form"], memo)
        clone._compiled = OrderedDict((signature, self.shared(compiled)) for signature, compiled in self._compiled.items())
        clone._sources = dict(self._sources)  # the same sources (bytes, files), not copies
        clone.__dict__["_in_memory"] = InMemory()  # counts them again: the original may go first
        clone._in_memory.hold(sum(len(s) for s in clone._sources.values() if isinstance(s, bytes)))
        clone._routes = dict(self._routes)
        return clone


def _output_node(partition: fx.GraphModule) -> fx.Node:
    return next(node for node in reversed(partition.graph.nodes) if node.op == "output")

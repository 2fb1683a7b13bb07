"""Hostile names in saved files and config documents (issue 17, reliability row 35, G11).

A name in a file or document is only looked up in qplug's name table. Every name below reaches
code (a shell, an importer, an unpickler, qplug's own factory loader) by some path that an
attribute-walking resolver would follow: directly, through ``builtins``, or through a module that
a qplug (or torch) module imports. Each one is written where a real file or document names
something (a graph's call target, a module class, a callable value, a type annotation, an
observer class, a fuser method, a pattern op ...), with arguments that would create a sentinel
file if it ever ran; each must be refused with qplug's error naming the field and the name, and
the sentinel must never appear. ``test_payloads_are_live`` shows the payloads do create the
sentinel when they are run directly, so the absence of the sentinel means something.
"""

from __future__ import annotations

import copy
import importlib
import os
import pkgutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from artifactkit import module, node, reference_model, rewrite_header
from torch import fx, nn

import qplug_core
import qplug_core as qp
from qplug_core.config import BackendConfig, BackendPatternConfig, QConfig, QConfigMapping
from qplug_core.config.names import name_table
from qplug_core.errors import ConfigValidationError, SerializationError
from qplug_core.serialization import load, save

#: names that reach code directly, through builtins, torch, or pickling
DIRECT = [
    "os.system", "os.popen", "os.execv", "os.remove", "os.spawnl", "posix.system",
    "subprocess.Popen", "subprocess.run", "subprocess.call", "subprocess.check_output",
    "subprocess.getoutput", "pty.spawn", "platform.popen",
    "eval", "exec", "__import__", "getattr", "compile", "open",
    "builtins.eval", "builtins.exec", "builtins.__import__", "builtins.compile", "builtins.open",
    "builtins.setattr", "builtins.globals", "builtins.breakpoint", "builtins.input",
    "importlib.import_module", "importlib.__import__", "importlib.util.spec_from_file_location",
    "operator.attrgetter", "operator.methodcaller", "operator.call", "_operator.attrgetter",
    "functools.partial", "functools.reduce",
    "torch.load", "torch.save", "torch.hub.load", "torch.hub.download_url_to_file",
    "torch.serialization.load", "torch.serialization._load", "torch.serialization.add_safe_globals",
    "torch.jit.load", "torch.package.PackageImporter", "torch.from_file", "torch.import_ir_module",
    "torch.ops.load_library", "torch.classes.load_library", "torch.utils.cpp_extension.load",
    "torch.utils.cpp_extension.subprocess.Popen", "torch.compile", "torch.set_num_threads",
    "torch.os.system", "torch.sys.modules", "torch.nn.functional.torch.load",
    "torch.nn.modules.conv.torch.load", "torch.nn.modules.conv.F.torch.hub.load",
    "torch.nn.modules.module.torch.save", "torch.functional.torch.load",
    "torch.nn.Module.__init__", "torch.nn.modules.conv.Conv2d.__init__",
    "torch.nn.modules.conv.Conv2d.__class__", "torch.Tensor.__reduce_ex__", "operator.__builtins__",
    "torch.ops.aten.from_file.default", "aten::from_file.default", "aten::from_file",
    "prim::Print.default", "aten::add.Tensor.__class__", "aten::_sparse_coo_tensor_unsafe.default",
    "torch.sparse_coo_tensor", "torch.fbgemm_linear_int8_weight", "torch.segment_reduce",
    "torch.frombuffer", "torch.from_numpy",
    "pickle.loads", "pickle.load", "_pickle.loads", "marshal.loads", "shelve.open",
    "ctypes.CDLL", "ctypes.cdll.LoadLibrary", "ctypes.pythonapi", "ctypes.memmove",
    "sys.modules", "sys.exit", "sys._getframe", "sys.settrace",
    "shutil.rmtree", "shutil.copy", "shutil.move", "runpy.run_path", "runpy.run_module",
    "code.interact", "code.InteractiveInterpreter", "pdb.set_trace", "webbrowser.open",
    "socket.socket", "urllib.request.urlopen", "tempfile.mkstemp", "pathlib.Path.write_text",
    "io.open", "codecs.open", "zipimport.zipimporter", "multiprocessing.Process",
    "threading.Thread", "signal.signal", "atexit.register", "asyncio.create_subprocess_shell",
    "qplug_core.cli._inputs.load_factory_model", "qplug_core.serialization.api.load",
    "qplug_core.serialization.load", "qplug_core.load", "qplug_core.quantize",
    "qplug_core.registry.plugins.reset", "qplug_core.config.names.register_serializable",
    "qplug_core.config.names.importlib.import_module", "qplug_core.testing.environment",
]

#: what each module kind re-exported by a qplug module is used for
_ATTACKS = {
    "os": ("system", "popen", "execv"), "sys": ("modules", "exit"), "importlib": ("import_module",),
    "builtins": ("eval", "exec"), "inspect": ("os.system", "importlib.import_module", "sys.modules"),
    "tempfile": ("_os.system",), "subprocess": ("Popen",), "resources": ("files",),
}


def reexported_names() -> list[str]:
    """``qplug_core.cli.app.os.system`` and friends: through every qplug module importing os & co."""
    names = []
    for info in pkgutil.walk_packages(qplug_core.__path__, "qplug_core."):
        module = importlib.import_module(info.name)
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, types.ModuleType):
                kind = value.__name__.rpartition(".")[2]
                names += [f"{info.name}.{attr}.{tail}" for tail in _ATTACKS.get(kind, ())]
        names.append(f"{info.name}.torch.load" if hasattr(module, "torch") else f"{info.name}.__dict__")
    return sorted(set(names))


HOSTILE = sorted(set(DIRECT + reexported_names()))


def test_the_suite_covers_at_least_50_names_and_every_reexport():
    assert len(HOSTILE) >= 50
    assert {"qplug_core.cli.app.os.system", "qplug_core.registry.plugins.importlib.import_module",
            "qplug_core.cli._inputs.os.system", "qplug_core.errors.sys.modules"} <= set(HOSTILE)


# -- payloads: what would create the sentinel if the name ever resolved and ran ---------------------


def payload(name: str, sentinel: Path) -> list[Any]:
    """JSON arguments that make ``name`` (if it ran) create ``sentinel``."""
    last = name.rpartition(".")[2]
    if last in ("Popen", "run", "call", "check_output", "spawn", "create_subprocess_shell"):
        return [["touch", str(sentinel)]]
    if last in ("eval", "exec", "compile", "interact"):
        return [f"open({str(sentinel)!r}, 'w').close()"]
    if last in ("run_path", "load", "loads", "import_module", "open", "write_text"):
        return [str(sentinel)]
    return [f"touch {sentinel}"]


def refusals(attempt: Callable[[str], Any], error: type[Exception], sentinel: Path,
             explains: Callable[[str, Any], bool]) -> list[str]:
    """Every hostile name for which ``attempt(name)`` does not raise ``error`` saying ``explains``,
    or after which the sentinel exists."""
    wrong = []
    for name in HOSTILE:
        try:
            attempt(name)
        except error as raised:
            if not explains(name, raised):
                wrong.append(f"{name}: {getattr(raised, 'field', None)!r}: {raised}")
        else:
            wrong.append(f"{name}: accepted")
        if sentinel.exists():
            wrong.append(f"{name}: RAN (sentinel created)")
    return wrong


def test_payloads_are_live(tmp_path):
    """Run directly (not through qplug), the payloads do create the sentinel."""
    for name, run in [("os.system", os.system), ("subprocess.run", subprocess.run),
                      ("builtins.exec", exec)]:
        sentinel = tmp_path / f"live-{name}"
        run(*payload(name, sentinel))
        assert sentinel.exists(), name


# -- files -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real file written by qp.save."""
    return save(reference_model(), tmp_path_factory.mktemp("hostile") / "good.safetensors")


@pytest.fixture
def sentinel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # relative payload paths land here too
    return tmp_path / "SENTINEL"


FILE_PLACES: dict[str, Callable[[dict[str, Any], str, list[Any]], None]] = {
    "graph call target": lambda d, n, a: node(d, "fc").update(op="call_function", target=n, args=a),
    "graph callable argument": lambda d, n, a: node(d, "fc").update(args=[{"callable": n}, *a]),
    "call_method target": lambda d, n, a: node(d, "fc").update(op="call_method", target=n,
                                                                  args=[{"node": "dequantize"}, *a]),
    "module class": lambda d, n, a: module(d, "quantize").update({"class": n}),
    "module callable attribute": lambda d, n, a: module(d, "quantize").setdefault("attrs", {}).update(
        hook={"callable": n}),
    "node type annotation": lambda d, n, a: node(d, "x").update(type={"class": n}),
}


HARMLESS_EDITS = {
    "type annotation": lambda doc: node(doc, "x").update(type={"class": "torch.Tensor"}),
    "tensor method": lambda doc: node(doc, "fc").update(op="call_method", target="relu",
                                                        args=[{"node": "dequantize"}]),
    "torch op": lambda doc: node(doc, "fc").update(op="call_function", target="torch.relu",
                                                   args=[{"node": "dequantize"}]),
    "getattr of a tensor attribute": lambda doc: node(doc, "fc").update(
        op="call_function", target="builtins.getattr", args=[{"node": "dequantize"}, "shape"]),
}


@pytest.mark.parametrize("edit", list(HARMLESS_EDITS))
def test_an_edited_file_still_loads_when_the_edit_is_harmless(edit, good_file, sentinel):
    """The control for the rewriting below: the same edits with legitimate names load."""
    path = rewrite_header(good_file, sentinel.with_name("edited.safetensors"), HARMLESS_EDITS[edit])
    assert isinstance(load(path), fx.GraphModule)


@pytest.mark.parametrize("place", list(FILE_PLACES))
def test_hostile_names_in_a_saved_file_are_refused_and_nothing_runs(place, good_file, sentinel):
    edit = FILE_PLACES[place]
    name_table()  # built (importing what it needs) before the snapshot
    before = set(sys.modules)
    path = sentinel.with_name("edited.safetensors")
    def attempt(name: str) -> None:
        rewrite_header(good_file, path, lambda doc: edit(doc, name, payload(name, sentinel)))
        load(path)

    wrong = refusals(attempt, SerializationError, sentinel,
                     lambda name, error: str(path) in str(error) and repr(name) in str(error))
    assert not wrong, "\n".join(wrong[:20])
    assert set(sys.modules) == before  # nothing was imported to resolve a name


# -- config documents ------------------------------------------------------------------------------


_MAPPING: list[dict[str, Any]] = []


def _mapping_doc() -> dict[str, Any]:
    if not _MAPPING:
        _MAPPING.append(qp.get_default_qconfig_mapping("reference").to_dict())
    return copy.deepcopy(_MAPPING[0])


def _pattern_doc(**fields: Any) -> dict[str, Any]:
    doc = {"schema_version": 1, "pattern": [{"op": "torch.nn.modules.conv.Conv2d"},
                                            {"op": "torch.nn.modules.activation.ReLU"}]}
    doc.update(fields)
    return doc


def _observer(name: str, args: list[Any]) -> dict[str, Any]:
    return {"class": name, "kwargs": {"args": {"tuple": args}}}


DOCUMENT_PLACES: dict[str, tuple[Callable[[str, list[Any]], Any], str]] = {
    "QConfigMapping observer class": (
        lambda n, a: QConfigMapping.from_dict({**_mapping_doc(), "global": {"activation": _observer(n, a)}}),
        "global.activation.class"),
    "QConfigMapping object type": (
        lambda n, a: QConfigMapping.from_dict({**_mapping_doc(), "object_type": [
            [{"op": n}, _mapping_doc()["global"]]]}),
        "object_type[0][0].op"),
    "QConfig weight class": (
        lambda n, a: QConfig.from_dict({"schema_version": 1, "activation": _mapping_doc()["global"]["activation"],
                                        "weight": _observer(n, a)}),
        "weight.class"),
    "observer kwargs value": (
        lambda n, a: QConfig.from_dict({"schema_version": 1, "activation": {
            "class": "qplug_core.observers.fake_quantize.FakeQuantize",
            "kwargs": {"observer": {"object": n}}}}),
        "activation.kwargs.observer.object"),
    "BackendPatternConfig fuser method": (
        lambda n, a: BackendPatternConfig.from_dict(_pattern_doc(fuser_method=n)), "fuser_method"),
    "BackendPatternConfig root module": (
        lambda n, a: BackendPatternConfig.from_dict(_pattern_doc(root_module=n)), "root_module"),
    "BackendPatternConfig pattern op": (
        lambda n, a: BackendPatternConfig.from_dict(_pattern_doc(pattern=[{"op": n}])), "pattern[0].op"),
    "BackendConfig fuser method": (
        lambda n, a: BackendConfig.from_dict({"schema_version": 1, "name": "evil", "configs": [
            {k: v for k, v in _pattern_doc(fuser_method=n).items() if k != "schema_version"}]}),
        "configs[0].fuser_method"),
}


@pytest.mark.parametrize("place", list(DOCUMENT_PLACES))
def test_hostile_names_in_a_config_document_are_refused_and_nothing_runs(place, sentinel):
    build, field = DOCUMENT_PLACES[place]
    name_table()
    before = set(sys.modules)
    wrong = refusals(lambda name: build(name, payload(name, sentinel)), ConfigValidationError, sentinel,
                     lambda name, error: error.field == field and field in str(error) and repr(name) in str(error))
    assert not wrong, "\n".join(wrong[:20])
    assert set(sys.modules) == before


def test_a_legitimate_document_still_prepares(sentinel):
    """The control: the documents above are valid once the hostile name is replaced."""
    doc = _mapping_doc()
    mapping = QConfigMapping.from_dict(copy.deepcopy(doc))
    assert mapping.to_dict() == doc
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    observed = qp.prepare_fx(model, mapping, (torch.randn(2, 4),), backend="reference")
    qp.calibrate(observed, [(torch.randn(2, 4),)], progress=False)
    assert isinstance(qp.convert_to_reference_fx(observed), fx.GraphModule)
    config = BackendPatternConfig.from_dict(_pattern_doc(fuser_method="qplug_core.nn.fuser_methods.fuse_conv_relu"))
    assert config.fuser_method is qplug_core.nn.fuser_methods.fuse_conv_relu


#: method and attribute names that reach interpreter internals, storages, numpy arrays or callbacks
HOSTILE_METHODS = [
    "__reduce__", "__reduce_ex__", "__class__", "__init__", "__getattribute__", "__setattr__",
    "__globals__", "__subclasses__", "__dict__", "_base", "mro", "storage", "untyped_storage", "numpy",
    "share_memory_", "set_", "apply_", "map_", "map2_", "register_hook", "grad_fn", "backward",
    "data_ptr", "system", "popen", "eval", "exec", "load", "save", "tofile", "dump", "from_file",
]


@pytest.mark.parametrize("place", ["call_method target", "getattr attribute"])
def test_hostile_method_names_in_a_saved_file_are_refused(place, good_file, sentinel):
    path = sentinel.with_name("edited.safetensors")

    def edit(doc: dict[str, Any], name: str) -> None:
        if place == "call_method target":
            node(doc, "fc").update(op="call_method", target=name, args=[{"node": "dequantize"}])
        else:
            node(doc, "fc").update(op="call_function", target="builtins.getattr",
                                   args=[{"node": "dequantize"}, name])

    wrong = []
    for name in HOSTILE_METHODS:
        rewrite_header(good_file, path, lambda doc, name=name: edit(doc, name))
        try:
            load(path)
        except SerializationError as error:
            if repr(name) not in str(error):
                wrong.append(f"{name}: {error}")
        else:
            wrong.append(f"{name}: loaded")
    assert not wrong, "\n".join(wrong)
    assert not sentinel.exists()

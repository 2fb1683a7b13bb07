"""The name table: kinds, aten overloads, the tensor-method allowlist, backends' registrations, and
files written before it.

The backend case registers a class-based fake plugin on the real manager (tier 1 of the plugin
tests): what it contributes to a backend becomes nameable in documents, and goes away with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from artifactkit import reference_model
from torch import nn

from qplug_core.config import BackendPatternConfig
from qplug_core.config.names import TENSOR_ATTRIBUTES, Kind, decode_name, encode_name, name_table
from qplug_core.errors import ConfigValidationError
from qplug_core.observers import MinMaxObserver
from qplug_core.registry import plugins
from qplug_core.registry.hookspecs import hookimpl
from qplug_core.serialization import load


def test_a_name_only_resolves_for_the_use_it_is_registered_for():
    assert decode_name("torch.nn.modules.conv.Conv2d", kinds=(Kind.MODULE,)) is nn.Conv2d
    with pytest.raises(ConfigValidationError, match="is registered as module/type, not as op") as info:
        decode_name("torch.nn.modules.conv.Conv2d", field="graph[3].target", kinds=(Kind.OP,))
    assert info.value.field == "graph[3].target"
    with pytest.raises(ConfigValidationError, match="is registered as fuser, not as observer"):
        decode_name("qplug_core.nn.fuser_methods.fuse_conv_bn", kinds=(Kind.OBSERVER,))
    assert decode_name("torch.nn.Conv2d") is nn.Conv2d  # public alias
    assert encode_name(nn.Conv2d) == "torch.nn.modules.conv.Conv2d"  # written where it is defined


def test_aten_overloads_resolve_by_their_exact_name_only():
    assert decode_name("aten::add.Tensor", kinds=(Kind.OP,)) is torch.ops.aten.add.Tensor
    assert encode_name(torch.ops.aten.relu.default, kinds=(Kind.OP,)) == "aten::relu.default"
    # einsum's ``path`` is a list of ints (a contraction order): not a file argument
    assert decode_name("aten::einsum.default", kinds=(Kind.OP,)) is torch.ops.aten.einsum.default
    for name in ("aten::add", "aten::add.NoSuchOverload", "aten::_softmax.default", "aten::from_file.default",
                 "aten::add.Tensor.__call__", "prim::Print.default", "quantized::linear.default"):
        with pytest.raises(ConfigValidationError, match="unknown or disallowed"):
            decode_name(name, kinds=(Kind.OP,))


def test_tensor_attribute_allowlist():
    assert {"view", "shape", "size", "relu", "contiguous", "dtype", "permute"} <= TENSOR_ATTRIBUTES
    assert not {"storage", "untyped_storage", "numpy", "grad_fn", "register_hook", "apply_", "set_",
                "__reduce__", "__class__", "_base"} & TENSOR_ATTRIBUTES


def fuse_conv_softsign(is_qat, conv, softsign):
    return nn.Sequential(conv, softsign)


class ClampingObserver(MinMaxObserver):
    pass


class ContributingPlugin:
    """Adds one fusion pattern (with its own fuser method) to the reference backend."""

    @hookimpl
    def qplug_backend_pattern_configs(self, backend):
        if backend != "reference":
            return []
        return [BackendPatternConfig((nn.Conv1d, nn.Softsign)).set_fuser_method(fuse_conv_softsign)]


def test_what_a_backend_registers_becomes_nameable_and_goes_away_with_it(register_plugin):
    fuser = f"{__name__}.fuse_conv_softsign"
    document = {"schema_version": 1, "pattern": [{"op": "torch.nn.modules.conv.Conv1d"},
                                                 {"op": "torch.nn.modules.activation.Softsign"}],
                "fuser_method": fuser}
    with pytest.raises(ConfigValidationError, match="fuser_method"):
        BackendPatternConfig.from_dict(document)
    register_plugin(ContributingPlugin(), "contributing")
    assert BackendPatternConfig.from_dict(document).fuser_method is fuse_conv_softsign
    plugins.reset()
    assert fuser not in name_table()


def test_a_file_written_before_the_name_table_still_loads():
    """A file of the current format (written by main at 9ff4cea, before the table) loads, because
    every name it holds maps through the table; the model is the same."""
    loaded = load(Path(__file__).parent / "data" / "reference_model_written_by_9ff4cea.safetensors")
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded(x), reference_model()(x), rtol=0, atol=0)


class DocumentPlugin:
    """Builds its pattern config from a JSON document, as a plugin shipping JSON configs would."""

    @hookimpl
    def qplug_backend_pattern_configs(self, backend):
        if backend != "reference":
            return []
        return [BackendPatternConfig.from_dict({
            "schema_version": 1, "pattern": [{"op": "torch.nn.modules.conv.Conv3d"},
                                             {"op": "torch.nn.modules.activation.Softsign"}],
            "fuser_method": "qplug_core.nn.fuser_methods.fuse_conv_relu"})]


def test_a_plugin_reading_a_document_while_backends_assemble(register_plugin):
    """Core names resolve without assembling backends, so a hook decoding a document while the
    table itself is assembling backends neither recurses nor sees a half-built table."""
    register_plugin(ContributingPlugin(), "contributing")
    register_plugin(DocumentPlugin(), "documents")
    with pytest.raises(ConfigValidationError, match="no.such"):
        decode_name("no.such.name")  # builds the whole table: backends, hence both hooks
    from qplug_core.registry.backends import get_backend

    patterns = [cfg.pattern for cfg in get_backend("reference").config.configs]
    assert (nn.Conv3d, nn.Softsign) in patterns and (nn.Conv1d, nn.Softsign) in patterns


def double(x):
    return x * 2


def test_registering_a_function_as_an_op_lets_graphs_call_it_and_nothing_else():
    from qplug_core.config import register_serializable

    name = register_serializable(double, "qplug_tests.names.double", kind="op")
    assert decode_name(name, kinds=(Kind.OP,)) is double
    assert encode_name(double, kinds=(Kind.OP,)) == name
    with pytest.raises(ConfigValidationError, match="is registered as op, not as fuser"):
        decode_name(name, kinds=(Kind.FUSER,))

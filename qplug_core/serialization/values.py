"""What a saved file may name and call: identifiers, ops, tensor methods, and its value codec.

A loaded file is untrusted, so decoding is deliberately narrow. Functions resolve only through
qplug's name table as :attr:`~qplug_core.config.names.Kind.OP` (tensor ops: no ``torch.load``,
no ``operator.attrgetter``, nothing from ``os``), methods and attributes only from the allowlist
of tensor methods (:data:`~qplug_core.config.names.TENSOR_ATTRIBUTES`), and identifiers, which
torch.fx pastes into the Python source it generates and executes, with :func:`check_identifier`.
"""

from __future__ import annotations

import keyword
import re
from typing import Any

from qplug_core.config.codec import ValueCodec, expect, where
from qplug_core.config.names import TENSOR_ATTRIBUTES, Kind, decode_name, encode_name
from qplug_core.errors import ConfigError

CALLABLE_TAG = "callable"
OP_KINDS = frozenset({Kind.OP})
#: the value codec of saved files: named values may only be ops
FILE_VALUES = ValueCodec(object_tag=CALLABLE_TAG, object_kinds=OP_KINDS, ordered_dicts=True,
                         factories=False)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_identifier(name: Any, path: str, what: str) -> str:
    """``name`` if it is a Python identifier (not a keyword), the only names fx may paste into code."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name) or keyword.iskeyword(name):
        raise ConfigError(f"{where(path)}: {what} {name!r} is not a plain Python identifier",
                          field=path, value=name)
    return name


def check_public(name: Any, path: str, what: str) -> str:
    """An identifier that does not start with an underscore (no dunder or private access)."""
    if check_identifier(name, path, what).startswith("_"):
        raise ConfigError(f"{where(path)}: {what} {name!r} is private; artifacts may only use public "
                          "names", field=path, value=name)
    return name


def check_tensor_attribute(name: Any, path: str, what: str) -> str:
    """A public tensor method or attribute name, the only ones a saved graph may call or read."""
    if check_public(name, path, what) not in TENSOR_ATTRIBUTES:
        raise ConfigError(f"{where(path)}: {what} {name!r} is not a tensor method or attribute a saved "
                          "model may use", field=path, value=name)
    return name


def encode_op(obj: Any, path: str) -> str:
    """The table name of a function a saved graph calls (so saving fails where loading would)."""
    return encode_name(obj, field=path, kinds=OP_KINDS)


def decode_op(name: Any, path: str) -> Any:
    """The op a saved graph names; anything else is a :class:`ConfigError` naming ``path``."""
    return decode_name(expect(name, str, path, "an op name"), field=path, kinds=OP_KINDS)

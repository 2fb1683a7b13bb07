"""The weight-only kernel a saved linear ran, as data in its file entry.

Kernels are chosen by timing (:mod:`qplug_core.weight_only.selection`), and they round differently
(ONNX Runtime's ``MatMulNBits`` quantizes activations per block, torch's ``_weight_int8pack_mm`` does
not): choosing again at every load made two processes loading one file answer differently. The
record is the kernel's name and the most rows it takes (``null``: all; the reference takes the
rest); ``qp.load`` looks the name up among the kernels installed there, nothing in it is imported
or run.

One kernel may also take another code path on a CPU with other int8 capabilities (VNNI or AVX2 dot
products, AVX-512 or AVX2 vectors summing in another order), so the file also records where the
kernels were chosen (:data:`CPU_KEY`: the machine and
:attr:`~qplug_core.kernels.cpu.CpuInt8.int8_capabilities`), and ``qp.load`` says when it runs
them on a CPU that differs (:func:`cpu_difference`).
"""

from __future__ import annotations

from typing import Any

from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.errors import ConfigError
from qplug_core.kernels.cpu import INT8_CAPABILITIES, CpuInt8
from qplug_core.kernels.weight_only import WeightOnlyKernel
from qplug_core.weight_only.selection import recorded_as

KEY = "kernel"
_FIELDS = ("name", "max_rows")
_MAX_NAME = 200
#: the document key of the CPU the kernels were chosen on
CPU_KEY = "kernel_cpu"
_CPU_FIELDS = ("machine", "int8")


def to_document(kernel: WeightOnlyKernel) -> dict[str, Any]:
    name, max_rows = recorded_as(kernel)
    return {"name": name, "max_rows": max_rows}


def from_document(doc: Any, path: str) -> tuple[str, int | None]:
    """The checked record (name, most rows); raises :class:`ConfigError` naming the bad field."""
    read_fields(doc, path, _FIELDS, required=_FIELDS)
    name = expect(doc["name"], str, child(path, "name"), "a kernel name")
    if not 0 < len(name) <= _MAX_NAME or not name.isprintable():
        raise ConfigError(f"{where(child(path, 'name'))}: {name[:_MAX_NAME]!r} is not a kernel name",
                          field=child(path, "name"), value=name[:_MAX_NAME])
    max_rows = doc["max_rows"]
    if max_rows is not None and not (expect(max_rows, int, child(path, "max_rows"), "a row count or null") > 0):
        raise ConfigError(f"{where(child(path, 'max_rows'))}: {max_rows} rows is not a positive count",
                          field=child(path, "max_rows"), value=max_rows)
    return name, max_rows


def cpu_of(cpu: CpuInt8) -> tuple[str, frozenset[str]]:
    """(machine, int8 capabilities): what the record says of a CPU."""
    return cpu.machine, cpu.int8_capabilities


def cpu_document(chosen_on: tuple[str, frozenset[str]]) -> dict[str, Any]:
    machine, capabilities = chosen_on
    return {"machine": machine, "int8": sorted(capabilities)}


def cpu_from_document(doc: Any, path: str) -> tuple[str, frozenset[str]]:
    """The checked CPU record; raises :class:`ConfigError` naming the bad field."""
    read_fields(doc, path, _CPU_FIELDS, required=_CPU_FIELDS)
    machine = expect(doc["machine"], str, child(path, "machine"), "a machine name")
    if not 0 < len(machine) <= _MAX_NAME or not machine.isprintable():
        raise ConfigError(f"{where(child(path, 'machine'))}: {machine[:_MAX_NAME]!r} is not a machine name",
                          field=child(path, "machine"), value=machine[:_MAX_NAME])
    names = expect(doc["int8"], list, child(path, "int8"), "a list of int8 capabilities")
    unknown = [name for name in names if name not in INT8_CAPABILITIES]
    if unknown:
        raise ConfigError(f"{where(child(path, 'int8'))}: {unknown[0]!r} is not one of "
                          f"{', '.join(INT8_CAPABILITIES)}", field=child(path, "int8"), value=unknown[0])
    return machine, frozenset(names)


def cpu_difference(chosen_on: tuple[str, frozenset[str]], here: CpuInt8) -> str | None:
    """How the CPU the kernels were chosen on differs from ``here`` for int8, or ``None``."""
    if chosen_on == cpu_of(here):
        return None
    return f"chosen on {_described(chosen_on)}, running on {_described(cpu_of(here))}"


def _described(cpu: tuple[str, frozenset[str]]) -> str:
    machine, capabilities = cpu
    names = [shown for name, shown in INT8_CAPABILITIES.items() if name in capabilities]
    return f"{machine} with {' + '.join(names)}" if names else f"{machine} without int8 dot-product extensions"

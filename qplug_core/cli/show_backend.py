"""``qplug show-backend NAME``: everything a backend contributes, as the flows will see it.

A backend is assembled from several plugins, so its pattern configs, kernels and fusions cannot be
read off one plugin's source; this shows the assembled result, in both pattern formats.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import typer

from qplug_core.cli._common import emit_json, say
from qplug_core.cli._table import new_table, show, terminal_width

#: short table labels of the observation types (JSON keeps the enum names)
_OBSERVATION_LABELS = {"OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT": "own",
                       "OUTPUT_SHARE_OBSERVER_WITH_INPUT": "shared",
                       "INPUT_OUTPUT_NOT_OBSERVED": "none"}


def _callable_name(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _short(dotted: str) -> str:
    return dotted.rsplit(".", 1)[-1]


def _dtype_name(value: Any) -> str:
    """``"torch.quint8"`` -> ``"quint8"``; a dtype with constraints gets a ``*``."""
    if isinstance(value, dict):
        return _short(value["dtype"]) + ("*" if len(value) > 1 else "")
    return _short(value) if value else "-"


def _dtype_text(doc: dict[str, Any]) -> str:
    """A DTypeConfig document as ``"quint8,qint8,float32->quint8"`` (input, weight, bias, output)."""
    inputs = [_dtype_name(doc.get(key)) for key in ("input_dtype", "weight_dtype", "bias_dtype")]
    while inputs[-1] == "-":
        inputs.pop()
    return (f"{','.join(inputs)}->{_dtype_name(doc.get('output_dtype'))}"
            + (" dyn" if doc.get("is_dynamic") else ""))


def _simple_text(pattern: Any) -> str | None:
    from qplug_core.errors import PatternError
    from qplug_core.patterns import format_pattern, to_simple_format

    try:
        simple = to_simple_format(pattern)
    except PatternError:
        return None
    if isinstance(simple, tuple):
        return "(" + ", ".join(format_pattern(op) for op in simple) + ")"
    return format_pattern(simple)


def pattern_rows(backend: Any) -> list[dict[str, Any]]:
    """One JSON-safe row per pattern config, in matching order of registration."""
    from qplug_core.patterns import format_pattern

    rows = []
    for cfg in backend.config.configs:
        pattern = cfg.pattern_complex_format
        kernel = backend.kernels.get(pattern)
        fuser = cfg.fuser_method or backend.fuser_methods.get(pattern)
        rows.append({
            "pattern": format_pattern(pattern),
            "simple": _simple_text(pattern),
            "observation_type": cfg.observation_type.name,
            "dtype_configs": [d.to_dict() for d in cfg.dtype_configs],
            "kernel": kernel.op if kernel is not None else None,
            "fuser_method": _callable_name(fuser),
            "fused_module": cfg.fused_module.__name__ if cfg.fused_module else None,
        })
    return rows


def _observer_text(doc: dict[str, Any] | None) -> str:
    """``{"class": ..., "kwargs": {...}}`` -> ``"HistogramObserver quint8 [0, 255]"``."""
    if doc is None:
        return "none"
    kwargs = doc.get("kwargs", {})
    name = _short(doc["class"]).removesuffix("Observer")
    if isinstance(kwargs.get("observer"), dict):
        name += f"({_short(kwargs['observer'].get('object', '?')).removesuffix('Observer')})"
    parts = [name]
    if isinstance(kwargs.get("dtype"), dict):
        parts.append(_short(kwargs["dtype"]["dtype"]))
    if "quant_min" in kwargs and "quant_max" in kwargs:
        parts.append(f"[{kwargs['quant_min']}, {kwargs['quant_max']}]")
    if isinstance(kwargs.get("qscheme"), dict):
        parts.append(_short(kwargs["qscheme"]["qscheme"]))
    if kwargs.get("is_dynamic"):
        parts.append("dynamic")
    return " ".join(parts)


def _qconfig_text(qconfig: Any) -> str:
    if qconfig is None:
        return "float (not quantized)"
    doc = qconfig.to_dict()
    return f"activation {_observer_text(doc['activation'])}; weight {_observer_text(doc['weight'])}"


def default_qconfigs(backend: Any) -> dict[str, dict[str, Any]]:
    """Per mode: the global qconfig in one line, overrides, and the op types kept in float."""
    from qplug_core.enums import MODES
    from qplug_core.errors import ConfigError
    from qplug_core.patterns import format_pattern

    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        try:
            mapping = backend.default_qconfig_mapping(mode)
            overrides = mapping.object_type_qconfigs.items()
            summary[mode] = {
                "available": True,
                "global": _qconfig_text(mapping.global_qconfig),
                "overrides": {format_pattern(op): _qconfig_text(qc) for op, qc in overrides
                              if qc is not None},
                "kept_float": [format_pattern(op) for op, qc in overrides if qc is None],
                "mapping": mapping.to_dict(),
            }
        except ConfigError as exc:  # no mapping for this mode, or one that cannot be described
            summary[mode] = {"available": False, "reason": str(exc)}
    return summary


#: the short dtype names of the compact view
_SHORT_DTYPES = {"quint8": "u8", "qint8": "s8", "qint32": "s32", "float32": "f32", "float16": "f16"}


def _family(pattern: Any) -> str:
    """The op a pattern is about, spelled once: Conv2d, F.conv2d, (Conv2d, BatchNorm2d),
    ConvReLU2d and qat.ConvBn2d are all ``conv2d``; torch.relu, F.relu_, "relu" and ReLU are
    ``relu``."""
    from qplug_core.errors import PatternError
    from qplug_core.patterns import format_pattern, to_simple_format

    try:
        simple = to_simple_format(pattern)
    except PatternError:
        simple = pattern
    while isinstance(simple, tuple):
        simple = simple[0]
    name = format_pattern(simple).rsplit(".", 1)[-1].strip("'\"").rstrip("_").lower()
    name = re.sub(r"^bnrelu(\d)d$", r"batchnorm\1d", name)
    name = re.sub(r"^linear(bn)?(relu)?(\dd)?$", "linear", name.replace("_", ""))
    return re.sub(r"^(convtranspose|conv)(bn)?(relu)?(\dd)?$", r"\1\4", name)


def _short_dtypes(doc: dict[str, Any]) -> str:
    text = _dtype_text(doc)
    for long, short in _SHORT_DTYPES.items():
        text = re.sub(rf"\b{long}\b", short, text)
    return text


def _families(backend: Any, rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for cfg, row in zip(backend.config.configs, rows):
        grouped.setdefault(_family(cfg.pattern_complex_format), []).append(row)
    return grouped


def _runs_on(has_kernels: bool, delegates: bool) -> str:
    """Where the int8 work of a backend runs, for the tables' titles."""
    if delegates:
        return ("int8 partitions compiled by its delegate" + (", other int8 ops on kernels in "
                                                               "torch.ops.quantized" if has_kernels else ""))
    return "kernels in torch.ops.quantized" if has_kernels else "reference form (no kernels)"


def _families_table(name: str, families: dict[str, list[dict[str, Any]]], runs_on: str) -> Any:
    """One line per family: how many patterns (and fusions), which kernels, which dtypes."""
    table = new_table("op", "patterns", "kernels", "dtypes",
                      title=f"backend {name}: {sum(map(len, families.values()))} pattern configs "
                            f"in {len(families)} op families; {runs_on}; "
                            "dtypes input,weight,bias->output (u8 quint8, s8 qint8, f32 float32, "
                            "* constrained, dyn dynamic); --full shows every pattern")
    for family, rows in families.items():
        kernels = sorted({row["kernel"].removeprefix("quantized::") for row in rows
                          if row["kernel"]})
        dtypes = sorted({_short_dtypes(d) for row in rows for d in row["dtype_configs"]})
        fusions = sum(bool(row["fuser_method"]) for row in rows)
        table.add_row(family, f"{len(rows)} ({fusions} fusions)" if fusions else str(len(rows)),
                      " ".join(kernels) or "-", " ".join(dtypes))
    return table


def _patterns_text(name: str, rows: list[dict[str, Any]], width: int) -> Any:
    """One block per pattern config: the complex format, then its facts on wrapped lines (a
    six-column table of long pattern names cannot fit 80 columns without breaking them)."""
    from rich.text import Text

    lines = textwrap.wrap(f"backend {name}: {len(rows)} pattern configs. obs: output observer "
                          "own / shared with input / none; dtypes: input,weight,bias->output "
                          "(u8 quint8, s8 qint8, f32 float32, * constrained, dyn dynamic)", width,
                          break_long_words=False, break_on_hyphens=False)
    for row in rows:
        facts = [f"simple {row['simple'] or '-'}",
                 f"obs {_OBSERVATION_LABELS.get(row['observation_type'], row['observation_type'])}",
                 "dtypes " + ", ".join(_short_dtypes(d) for d in row["dtype_configs"]),
                 f"kernel {row['kernel'] or '-'}"]
        if row["fuser_method"]:
            facts.append(f"fusion {_short(row['fuser_method'])} -> {row['fused_module'] or '?'}")
        lines += textwrap.wrap(row["pattern"], width, break_long_words=False,
                               break_on_hyphens=False, subsequent_indent="  ")
        lines += textwrap.wrap("; ".join(facts), width, initial_indent="    ",
                               subsequent_indent="    ", break_long_words=False,
                               break_on_hyphens=False)
    return Text("\n".join(lines))


def _qconfig_table(name: str, qconfigs: dict[str, dict[str, Any]]) -> Any:
    """Per mode: the global qconfig, the op types that get another one, those kept in float."""
    table = new_table("mode", "applies to", "qconfig",
                      title=f"backend {name}: default qconfigs (observer classes without their "
                            "Observer suffix)")
    for mode, entry in qconfigs.items():
        if not entry["available"]:
            table.add_row(mode, "-", entry["reason"])
            continue
        table.add_row(mode, "everything else", entry["global"])
        grouped: dict[str, list[str]] = {}
        for op, text in entry["overrides"].items():
            grouped.setdefault(text, []).append(op)
        for text, ops in grouped.items():
            table.add_row("", ", ".join(ops), text)
        if entry["kept_float"]:
            table.add_row("", ", ".join(entry["kept_float"]), "kept in float")
    return table


def show_backend(
    name: str = typer.Argument(..., help="Backend name, as in `qplug list-backends`."),
    pattern: str = typer.Option(None, "--pattern", help="Only patterns whose text contains this "
                                                        "(e.g. BatchNorm2d)."),
    op: str = typer.Option(None, "--op", help="Only the pattern family of this op (e.g. Conv2d, "
                                              "linear)."),
    full: bool = typer.Option(False, "--full", help="Every pattern config in full, not one line "
                                                    "per family."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Show a backend's pattern families, kernels and default qconfigs (--full: every pattern in
    both formats, with fusions)."""
    from qplug_core.registry.backends import get_backend

    backend = get_backend(name)
    availability = backend.availability()
    families = _selected(_families(backend, pattern_rows(backend)), pattern, op)
    rows = [row for family_rows in families.values() for row in family_rows]
    qconfigs = default_qconfigs(backend)
    header = {"name": backend.name, "description": backend.description, "engine": backend.engine,
              "status": backend.status, "reason": availability.reason,
              "plugins": [{"name": r.name, "dist": r.dist, "version": r.version}
                          for r in backend.contributors],
              "n_kernels": len(backend.kernels), "delegate": backend.delegate is not None}
    if as_json:
        emit_json({"backend": header, "pattern_configs": rows, "default_qconfigs": qconfigs})
        return
    plugins = ", ".join(f"{p['dist'] or p['name']} {p['version'] or ''}".strip()
                        for p in header["plugins"])
    width = terminal_width()
    say("\n".join([
        *textwrap.wrap(f"{backend.name}: {backend.description}", width, subsequent_indent="  "),
        *textwrap.wrap(f"engine {backend.engine or 'none'}, status {backend.status}"
                       f"{': ' + availability.reason if availability.reason else ''}, plugins: "
                       f"{plugins}", width, initial_indent="  ", subsequent_indent="  ")]))
    runs_on = _runs_on(bool(backend.kernels), header["delegate"])
    patterns = (_patterns_text(backend.name, rows, width) if full
                else _families_table(backend.name, families, runs_on))
    show(patterns, _qconfig_table(backend.name, qconfigs))


def _selected(families: dict[str, list[dict[str, Any]]], pattern: str | None, op: str | None
              ) -> dict[str, list[dict[str, Any]]]:
    """The families (and rows) matching ``--op`` and ``--pattern``; an error when none does."""
    from qplug_core.errors import ConfigError, did_you_mean

    if op is not None:
        wanted = {f: rows for f, rows in families.items()
                  if op.lower() in (f.lower(), f.rsplit(".", 1)[-1].lower())}
        if not wanted:  # ``--op conv``: every family it begins (Conv1d, Conv2d, F.conv2d, ...)
            wanted = {f: rows for f, rows in families.items()
                      if f.rsplit(".", 1)[-1].lower().startswith(op.lower())}
        if not wanted:
            raise ConfigError(f"no pattern family for --op {op!r}"
                              f"{did_you_mean(op, [f.rsplit('.', 1)[-1] for f in families])}",
                              field="--op", value=op)
        families = wanted
    if pattern is not None:
        families = {f: kept for f, rows in families.items()
                    if (kept := [r for r in rows if pattern.lower() in
                                 (r["pattern"] + " " + (r["simple"] or "")).lower()])}
        if not families:
            raise ConfigError(f"no pattern contains {pattern!r}", field="--pattern", value=pattern)
    return families


def register(app: typer.Typer) -> None:
    app.command("show-backend")(show_backend)

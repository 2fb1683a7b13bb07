"""The ``qplug`` command line: backends, plugins and environment health.

Listings go to stdout (a table, or one stable JSON schema with ``--json``); diagnostics and plugin
warnings go to stderr, one line each. Exit codes: 0 success, 1 a :class:`QplugError`, 2 a usage
error, 3 a plugin failure under ``--strict`` / ``QPLUG_STRICT_PLUGINS=1``. Tracebacks only with
``QPLUG_DEBUG=1``. torch is imported only by commands that need it, so ``qplug --version`` and
``qplug list-backends --no-load`` stay fast.

Commands living in other modules are added by listing the module in :data:`COMMAND_MODULES`; it
defines ``register(app: typer.Typer) -> None``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterator

import typer
from typer.core import TyperGroup

from qplug_core.cli._common import UsageError, emit_json, say
from qplug_core.enums import BackendStatus
from qplug_core.errors import PluginError, QplugError, cli_audience
from qplug_core.registry import plugins

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PLUGIN_FAILURE = 3
ENV_DEBUG = "QPLUG_DEBUG"
FAILED_PLUGIN = (plugins.PluginStatus.BROKEN, plugins.PluginStatus.CONFLICT,
                 plugins.PluginStatus.INCOMPATIBLE)
FAILED_BACKEND = (BackendStatus.BROKEN, BackendStatus.CONFLICT)
COMMAND_MODULES: tuple[str, ...] = (
    "qplug_core.cli.demo",
    "qplug_core.cli.show_backend",
    "qplug_core.cli.quantize",
    "qplug_core.cli.report_cmd",
    "qplug_core.cli.bench",
    "qplug_core.cli.new_backend",
    "qplug_core.cli.export",
)


class QplugGroup(TyperGroup):
    """Turns a :class:`QplugError` from any command into one stderr line and an exit code."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QplugError as exc:
            if os.environ.get(ENV_DEBUG) == "1":
                raise
            say(f"qplug: error: {' '.join(str(exc).split())}", err=True)
            strict = os.environ.get(plugins.ENV_STRICT) == "1"
            raise typer.Exit(EXIT_PLUGIN_FAILURE if strict and isinstance(exc, PluginError)
                             else EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR) from exc


app = typer.Typer(cls=QplugGroup, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  add_completion=False, rich_markup_mode=None,
                  help="Plugin-based int8 quantization for PyTorch.")


def _from_qplug(filename: str) -> bool:
    """Whether a warning was attributed to qplug, a plugin, or the command line machinery that
    ``warn_user`` walks out to (it points at the caller's frame, which under the CLI is click's)."""
    packages = [module for name, module in list(sys.modules.items()) if "." not in name
                and (name.startswith("qplug_") or name in ("typer", "click"))]
    roots = [Path(module.__file__).parent for module in packages if getattr(module, "__file__", None)]
    path = Path(filename)
    return any(path.is_relative_to(root) for root in roots)


@contextlib.contextmanager
def _qplug_warnings_on_stderr() -> Iterator[None]:
    """Show each warning qplug or a plugin gives as one ``qplug: warning: ...`` line on stderr while
    a command runs (not ``.../typer/main.py:1445: UserWarning: ...``); torch's and other libraries'
    warnings keep Python's format, which names where they come from."""
    original = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if issubclass(category, plugins.QplugPluginWarning):
            say(f"qplug: {str(message).removeprefix('qplug: ')}", err=True)
        elif _from_qplug(filename):
            text = " ".join(str(message).split()).removeprefix("qplug: ")
            say(f"qplug: warning: {text}", err=True)
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("default", plugins.QplugPluginWarning)
        warnings.showwarning = show
        yield


def _version_text() -> str:
    """Core and plugin distribution versions, from metadata only (nothing is imported)."""
    lines = [f"qplug-core {plugins.core_version() or '0+unknown (not installed)'}"]
    dists = dict.fromkeys((info.dist, info.version) for info in plugins.discover())
    lines += [f"{dist} {version}" for dist, version in dists]
    return "\n".join(lines)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_version_text())
        raise typer.Exit()


@app.callback()
def _root(ctx: typer.Context,
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Show qplug-core and plugin versions and exit.")) -> None:
    ctx.with_resource(_qplug_warnings_on_stderr())
    ctx.with_resource(cli_audience())


@app.command()
def version() -> None:
    """Show qplug-core and plugin versions."""
    typer.echo(_version_text())


def _print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from qplug_core.cli._table import new_table, show

    table = new_table(*columns, title=title)
    for row in rows:
        table.add_row(*row)
    show(table)


def _print_failures(records: list[plugins.PluginRecord]) -> None:
    for record in records:
        if record.status in FAILED_PLUGIN:
            say(f"{record.status.value}: {record.error}")


def _plugin_rows(records: list[plugins.PluginRecord]) -> list[list[str]]:
    """plugin, distribution, status, reason (the entry-point module is in ``--json``: at 80
    columns it would not fit beside them)."""
    return [[r.name, f"{r.dist or '-'} {r.version or ''}".strip(), r.status.value,
             " ".join(str(r.error or "").split())] for r in records]


def _load_time(record: plugins.PluginRecord) -> str:
    return "-" if record.load_seconds is None else f"{record.load_seconds:.3f} s"


def _kernels_cell(row: Any) -> str:
    """The kernel count, or ``delegate`` for a backend that compiles partitions instead."""
    from qplug_core.registry.backends import get_backend

    if row.n_kernels or not row.available:
        return str(row.n_kernels)
    try:
        delegates = get_backend(row.name).delegate is not None
    except QplugError:  # a broken backend's row already says why
        delegates = False
    return "delegate" if delegates else str(row.n_kernels)


def _finish(strict: bool, failures: int) -> None:
    """Exit 3 when asked to be strict and something failed (the listing is printed first)."""
    if failures and (strict or os.environ.get(plugins.ENV_STRICT) == "1"):
        typer.echo(f"qplug: {failures} plugin failure(s), exiting with {EXIT_PLUGIN_FAILURE} "
                   f"(--strict)", err=True)
        raise typer.Exit(EXIT_PLUGIN_FAILURE)


@app.command("list-backends")
def list_backends_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 3 if any plugin failed."),
    no_load: bool = typer.Option(False, "--no-load",
                                 help="List entry points from metadata, importing nothing."),
) -> None:
    """List backends, the plugins providing them and whether they run here."""
    if no_load:
        records = [candidate.record for candidate in plugins.plan()[0]]
        if as_json:
            emit_json({"loaded": False, "backends": [], "plugins": [r.to_dict() for r in records]})
        else:
            _print_table("qplug plugins (not imported)",
                         ["plugin", "distribution", "status", "reason"], _plugin_rows(records))
        _finish(strict, sum(r.status in FAILED_PLUGIN for r in records))
        return
    from qplug_core.registry.backends import list_backends

    rows = list_backends()
    records = plugins.plugin_records()
    if as_json:
        emit_json({"loaded": True, "backends": [row.to_dict() for row in rows],
                    "plugins": [r.to_dict() for r in records]})
    else:
        _print_table("qplug backends", ["backend", "plugin", "patterns", "kernels", "status",
                                        "available"],
                     [[row.name, ", ".join(f"{r.dist} {r.version or ''}".strip()
                                           for r in row.contributors),
                       str(row.n_pattern_configs), _kernels_cell(row), row.status,
                       "yes" if row.available else f"no: {row.reason}"] for row in rows])
        _print_failures(records)
    _finish(strict, sum(r.status in FAILED_PLUGIN for r in records)
            + sum(row.status in FAILED_BACKEND for row in rows))


@app.command("plugins")
def plugins_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """List every plugin seen (built-in and installed) with its status and import time (what the
    plugin itself imports: torch, imported before, is not counted); --json adds entry points."""
    records = plugins.plugin_records()
    if as_json:
        emit_json({"plugins": [r.to_dict() for r in records]})
    else:
        _print_table("qplug plugins", ["plugin", "distribution", "status", "reason",
                                       "load time"],
                     [row + [_load_time(r)] for row, r in zip(_plugin_rows(records), records)])


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Check this environment: torch, quantized engines, plugins and each backend's own checks."""
    from qplug_core.cli._table import terminal_width
    from qplug_core.flows.default_fit import default_fit_diagnostics
    from qplug_core.registry.backends import environment_diagnostics

    findings = environment_diagnostics() + default_fit_diagnostics()
    if as_json:
        emit_json({"diagnostics": [{"scope": scope, "level": d.level, "message": d.message,
                                     "hint": d.hint} for scope, d in findings]})
        return
    for scope, finding in findings:
        hint = f" ({finding.hint})" if finding.hint else ""
        say(textwrap.fill(f"[{finding.level}] {scope}: {finding.message}{hint}",
                                 terminal_width(), subsequent_indent="    ",
                                 break_on_hyphens=False))


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point (``qplug``)."""
    app(prog_name="qplug")


if __name__ == "__main__":
    main()

"""The hooks a qplug plugin may implement.

Only specs and their documentation live here. Hooks are always *called* with keyword arguments, by
:func:`qplug_core.registry.plugins.collect` (never ``pm.hook.X(...)``), which also checks every return value
against the annotation below; a plugin may accept any subset of a hook's arguments, as in pluggy.
Parameters are declared positional-or-keyword because pluggy ignores keyword-only parameters when it
validates implementations. The names in the annotations are imported under ``TYPE_CHECKING`` below,
and only there: the plugin manager reads that block to resolve them when it checks a return value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping
    from qplug_core.kernels.base import KernelSpec
    from qplug_core.kernels.weight_only import WeightOnlyKernel
    from qplug_core.patterns import Pattern
    from qplug_core.registry.contract import BackendSpec, Delegate, Diagnostic

PROJECT_NAME = "qplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- Registration: which backends exist and which one is the default (read when plugins load) ---


@hookspec
def qplug_register_backends() -> list[BackendSpec]:
    """Declare the backends this plugin provides.

    :return: one :class:`~qplug_core.registry.backends.BackendSpec` per backend; a name registered by two
        plugins is a conflict and neither is used.

    Not firstresult: every plugin's list is collected.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def qplug_select_default_backend(available: list[str]) -> str | None:
    """Pick the backend used when the user names none.

    :param available: names of the backends that are healthy and available on this machine.
    :return: one of ``available``, or ``None`` to leave the choice to others (and finally to the
        core, which picks ``reference``). A backend plugin answers with its own name where it is
        the best choice (fbgemm on x86, qnnpack on ARM); the core names no plugin.
        ``BackendPlugin`` answers for you on the machines in ``preferred_machines``.

    firstresult: the most recently registered plugin that answers wins.

    .. versionadded:: 0.1
    """


@hookspec
def qplug_check_environment(backend: str) -> list[Diagnostic]:
    """Check that this machine can run ``backend`` well (engines, CPU features, versions).

    :param backend: backend name.
    :return: findings shown by ``qplug doctor``; an empty list when there is nothing to say.

    Not firstresult: findings of all plugins are shown.

    .. versionadded:: 0.1
    """


# -- Assembly: what a backend is made of, collected once from every plugin into a Backend value ---


@hookspec
def qplug_backend_pattern_configs(backend: str) -> list[BackendPatternConfig]:
    """Contribute pattern configs to ``backend`` (any plugin may extend any backend).

    :param backend: name of the backend being assembled.
    :return: the configs to add (an empty list when the plugin has nothing for ``backend``); a
        pattern contributed twice for one backend is an error naming both plugins.

    Not firstresult: contributions of all plugins are merged.

    .. versionadded:: 0.1
    """


@hookspec
def qplug_fuser_methods(backend: str) -> dict[Pattern, Callable]:
    """Contribute fuser methods (matched float modules -> fused module) to ``backend``.

    :param backend: name of the backend being assembled.
    :return: fuser method by pattern; the same pattern from two plugins is an error.

    Not firstresult: contributions of all plugins are merged.

    .. versionadded:: 0.1
    """


@hookspec
def qplug_int8_kernels(backend: str) -> dict[Pattern, KernelSpec]:
    """Contribute int8 kernels to ``backend``.

    :param backend: name of the backend being assembled.
    :return: kernel by the complex-format pattern of the ``BackendPatternConfig`` it lowers; the
        same pattern from two plugins is an error.

    Not firstresult: contributions of all plugins are merged.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def qplug_default_qconfig_mapping(backend: str, mode: str) -> QConfigMapping | None:
    """Give the default qconfig mapping of ``backend`` for one workflow.

    :param backend: backend name.
    :param mode: ``"static"``, ``"qat"`` or ``"dynamic"``.
    :return: the mapping, or ``None`` to let another plugin answer.

    firstresult: the most recently registered plugin that answers wins, so an extension plugin
    can override the defaults of the plugin that registered the backend.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def qplug_delegate(backend: str) -> Delegate | None:
    """Take whole int8 subgraphs of ``backend`` to a runtime that compiles them (ORT, an NPU SDK).

    :param backend: backend name.
    :return: a :class:`~qplug_core.registry.contract.Delegate` (an ``OperatorSupportBase`` saying which
        nodes of the reference form the runtime takes, and ``compile(partition, example_inputs)``
        returning one module per partition), or ``None`` for a backend without delegation.
        Convert groups the supported nodes with ``CapabilityBasedPartitioner``, compiles each
        partition holding int8 work, and leaves every other node in PyTorch; the report lists the
        partitions and what stayed outside and why (the support's ``unsupported_reason``, when it
        gives one). ``qp.load`` compiles again.

    firstresult: the most recently registered plugin that answers wins.

    .. versionadded:: 0.1
    """


@hookspec
def qplug_passes(stage: str, backend: str) -> list[Callable]:
    """Graph passes to run at a stage of the flows, for ``backend``.

    :param stage: one of ``"pre_fuse"``, ``"post_prepare"``, ``"pre_convert"``, ``"post_convert"``
        (:class:`qplug_core.enums.Stage`).
    :param backend: backend name.
    :return: passes (``PassBase`` instances or functions taking a GraphModule and returning a
        ``PassResult``, a GraphModule or ``None``); they run in order through the core's
        PassManager, on the model being quantized. A pass that raises fails the flow with an
        error naming the plugin.

    Not firstresult: passes of all plugins run, in plugin registration order.

    .. versionadded:: 0.1
    """


# -- Weight-only quantization: kernel candidates, asked when qp.quantize_weights runs ----------


@hookspec
def qplug_weight_only_kernels(backend: str) -> list[WeightOnlyKernel]:
    """Contribute weight-only kernels (int8/int4 weights, float activations) for ``backend``.

    :param backend: backend name; answer with an empty list for backends that are not yours.
    :return: :class:`~qplug_core.plugin_api.WeightOnlyKernel` instances (each says which bits,
        group sizes and activation dtypes it runs, packs a weight once and runs
        ``x @ dequantize(W).T + b``). ``qp.quantize_weights`` checks each against the core's
        reference and times it once per process; the fastest correct one runs.

    Not firstresult: kernels of all plugins are candidates.

    .. versionadded:: 0.1
    """

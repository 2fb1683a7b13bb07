"""Which modules tracing must keep opaque: qplug's own fused and QAT modules.

They are ``nn.Sequential`` subclasses or live outside ``torch.nn``, so torch.fx would trace into them
and the patterns that match them by type would never see them.
"""

from __future__ import annotations

import functools

from torch import nn


@functools.lru_cache(maxsize=None)
def leaf_module_classes() -> tuple[type[nn.Module], ...]:
    import qplug_core.nn as qnn
    from qplug_core.nn import intrinsic, qat

    found = []
    for namespace in (vars(intrinsic), vars(qat), vars(qnn)):
        for value in namespace.values():
            if (isinstance(value, type) and issubclass(value, nn.Module)
                    and value.__module__.startswith("qplug_core.nn") and value not in found):
                found.append(value)
    return tuple(found)

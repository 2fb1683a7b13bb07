"""The installed qplug-qnnpack distribution is discovered through its entry point and assembled."""

from __future__ import annotations

import pytest
import torch

from qplug_core import plugins
from qplug_core.backend import get_backend, list_backends
from qplug_core.errors import BackendNotFoundError
from qplug_core.testing import all_plugins_loaded, require_distribution

require_distribution("qplug-qnnpack")


@pytest.fixture(autouse=True)
def installed_plugins():
    with all_plugins_loaded():
        yield


def test_backend_is_listed_with_real_availability():
    info = next(i for i in list_backends() if i.name == "qnnpack")
    assert [(r.dist, r.name) for r in info.contributors] == [("qplug-qnnpack", "qnnpack")]
    assert info.available is ("qnnpack" in torch.backends.quantized.supported_engines)
    assert info.n_pattern_configs > 0


def test_misspelled_name_suggests_qnnpack():
    with pytest.raises(BackendNotFoundError, match="did you mean 'qnnpack'"):
        get_backend("qnnpak")


def test_with_only_qnnpack_loaded_there_is_no_fbgemm(monkeypatch):
    monkeypatch.setenv(plugins.ENV_LOAD, "qnnpack")
    plugins.reset()
    assert sorted(i.name for i in list_backends()) == ["qnnpack", "reference"]
    with pytest.raises(BackendNotFoundError, match="pip install qplug-fbgemm"):
        get_backend("fbgemm")

"""Every installed plugin loaded, one intra-op thread (the machine is shared)."""

from __future__ import annotations

import logging

import pytest

from qplug_core.testing import all_plugins_loaded, one_thread, require_distribution

require_distribution("qplug-onnxruntime")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-missing notices


@pytest.fixture(autouse=True)
def installed_plugins():
    with all_plugins_loaded(), one_thread():
        yield

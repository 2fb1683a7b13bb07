"""Every installed plugin loaded (the pytest plugin's ``qplug_only``), one intra-op thread (the
machine is shared)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("qplug_openvino", reason="qplug-openvino is not installed "
                                            "(pip install -e plugins/qplug_openvino)")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-missing notices


@pytest.fixture(autouse=True)
def installed_plugins(qplug_only):
    qplug_only()  # no names: every installed plugin, as outside the tests
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

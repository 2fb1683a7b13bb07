"""Fixtures for the nn tests: qconfigs whose weight factory builds the test fake quants."""

from __future__ import annotations

import pytest
from nn_test_helpers import RowFloatQParamsFakeQuant, SwitchableFakeQuant
from torch import nn


class _QConfig:
    def __init__(self, weight: type[nn.Module]):
        self.weight = weight
        self.activation = nn.Identity


@pytest.fixture
def qconfig():
    SwitchableFakeQuant.enabled = True
    yield _QConfig(SwitchableFakeQuant)
    SwitchableFakeQuant.enabled = True


@pytest.fixture
def no_fake_quant(qconfig):
    """A qconfig whose weight fake quant is switched off: QAT modules must equal float ones."""
    SwitchableFakeQuant.enabled = False
    return qconfig


@pytest.fixture
def embedding_qconfig():
    return _QConfig(RowFloatQParamsFakeQuant)

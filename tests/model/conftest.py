"""Fixtures: the tiny MoE model in float32 and float64."""

import pytest
import torch

from tests.model.models import make_model
from tokenmdp.model import MoETransformer


@pytest.fixture
def model32() -> MoETransformer:
    return make_model()


@pytest.fixture
def model64() -> MoETransformer:
    return make_model(dtype=torch.float64)

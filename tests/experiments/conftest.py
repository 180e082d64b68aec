"""The experiments compose their jobs through ``experiments.common.compose_raw``; here it takes the tests' quick
path to the same dict (``tests.conftest.compose_raw_quickly``), so checking that dozens of rows
compose costs milliseconds each rather than a hydra composition each."""

from __future__ import annotations

import pytest

from experiments import common
from tests.conftest import compose_raw_quickly


@pytest.fixture(autouse=True)
def quick_composition(monkeypatch):
    monkeypatch.setattr(common, "compose_raw", compose_raw_quickly)

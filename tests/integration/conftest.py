"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import warm_module


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The module's jobs start warm (a restarted rank too), from one local server for the module:
    its many jobs would otherwise spend most of their time importing torch in every rank
    (tests/conftest.warm_module). A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("warm_start")``; the others keep the cold path."""
    with warm_module(tmp_path_factory):
        yield

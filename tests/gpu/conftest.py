"""The CUDA tests need a GPU: on a machine without one they fail with the reason, never skip.

They are deselected by default (pyproject's ``-m "not gpu"``, since CI has no GPU) and run
with ``python3 -m pytest -m gpu tests/gpu`` on a machine that has one (docs/precision.md).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA GPU: torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda})", pytrace=False)

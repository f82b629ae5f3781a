"""The stress suite's mode in the test report's header (sizes: `_stress.size`)."""

from __future__ import annotations

import pytest
from _stress import MODE


def pytest_report_header(config: pytest.Config) -> str:
    return f"dbo stress mode: {MODE} (DBO_STRESS=long for the full size)"

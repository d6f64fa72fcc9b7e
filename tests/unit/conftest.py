"""Fixtures shared by several unit test files of this folder: docker-compose.yml as compose reads
it and its services (the static compose checks, test_compose_*.py). The stack-wide fixtures,
Kafka and the S3 endpoint, are in tests/conftest.py."""

from __future__ import annotations

from typing import Any

import pytest
from compose_model import load_compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml as compose reads it with no variables set (every default applies)."""
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found

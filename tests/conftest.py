"""Shared test helpers: paths to the test models and the reference data."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODELS = TESTS / "models"
REFERENCE = TESTS.parent.parent / "shared" / "reference"


def megatron_rows() -> list[dict[str, str]]:
    """Rows of Narayanan et al. 2021 Table 1 (shared/reference/megatron_2021_table1.csv)."""
    path = REFERENCE / "megatron_2021_table1.csv"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return MODELS

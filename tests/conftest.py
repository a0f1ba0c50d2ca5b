"""Shared test helpers: paths to the test models and the reference data."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlm.planner.cost.calibration import read_table, table_path

TESTS = Path(__file__).resolve().parent
MODELS = TESTS / "models"


def megatron_rows() -> list[dict[str, str]]:
    """Rows of Narayanan et al. 2021 Table 1 (profiles/calibration/megatron_2021_table1.csv)."""
    return read_table(table_path("megatron_2021_table1.csv"))


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return MODELS

"""Pinned layout fields hold in the search's result, including through the stage MILP (issue 13, item 3)."""

from __future__ import annotations

import pytest
from conftest import megatron_rows

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.search.layouts import PlanRequest, search


@pytest.mark.parametrize("row", megatron_rows()[3:6], ids=lambda r: r["params_b"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_pinned_recompute_holds_with_micro_batch_free(row: dict[str, str], recompute: str) -> None:
    """Before this test, `--recompute full` on these Table 1 rows came back as "none": the stage MILP, free to
    recompute any number of blocks, chose zero where memory allowed. A pin means every block recomputes."""
    b = float(row["params_b"])
    ir = capture(load_model_spec("megatron-1t" if b >= 1000 else f"megatron-{b:g}b"))
    request = PlanRequest(
        num_gpus=int(row["gpus"]),
        global_batch=int(row["global_batch"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        recompute=recompute,
        refine=2,
    )
    result = search(ir, request, *resolve("a100-80gb", "dgx-a100"))
    for cand in result.ranked:
        assert cand.layout.recompute == recompute
        assert (cand.layout.tp, cand.layout.pp) == (request.tp, request.pp)
        if cand.assignment is not None and cand.assignment.recompute_blocks is not None:
            assert cand.assignment.recompute_blocks == cand.assignment.blocks_per_stage

"""Calibration: predicted vs published TFLOP/s per GPU on Narayanan et al. 2021, Table 1 (all ten rows)."""

from __future__ import annotations

import statistics

import pytest

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.calibration import calibrate, eq3_flops, read_table, table_path
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.step_time import summarize

MEAN_TARGET = 0.05
WORST_TARGET = 0.10


@pytest.fixture(scope="module")
def rows():
    gpu, cluster = resolve("a100-80gb", "dgx-a100")
    return calibrate(table_path("megatron_2021_table1.csv"), gpu, cluster)


@pytest.mark.parametrize("preset,layers,hidden", [("megatron-1.7b", 24, 2304), ("megatron-7.5b", 36, 4096)])
def test_eq3_against_flops_counted_on_the_captured_graph(preset, layers, hidden):
    """Eq. 3 (closed form) against the matmul + attention FLOPs the capture counts op by op: with recompute each
    block runs its forward twice and its backward (2x forward), the logits layer forward + backward only."""
    inputs = summarize(capture(load_model_spec(preset)))
    graph = 4 * inputs.num_blocks * inputs.block.model_flops + 3 * (inputs.pre.model_flops + inputs.post.model_flops)
    for batch in (1, 512):
        assert eq3_flops(batch, 2048, layers, hidden, 51200) == pytest.approx(batch * graph, rel=0.01)


def test_table_rows_are_self_consistent_and_all_predicted(rows):
    """The committed rows obey the paper's own relations (Eq. 2 parameter count, aggregate = per GPU x GPUs,
    percent of the 312 TFLOP/s peak), and every row is evaluated at its published tp, pp, GPUs and batch."""
    table = read_table(table_path("megatron_2021_table1.csv"))
    assert len(rows) == len(table) == 10
    for r, t in zip(rows, table):
        layers, h, v, s = int(t["layers"]), int(t["hidden"]), 51200, 2048
        eq2 = 12 * layers * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
        assert abs(eq2 / 1e9 - float(t["params_b"])) <= max(0.05, 0.01 * float(t["params_b"]))  # 0.1B rounding
        assert float(t["tflops_per_gpu"]) * int(t["gpus"]) / 1e3 == pytest.approx(float(t["agg_pflops"]), rel=0.01)
        assert 100 * float(t["tflops_per_gpu"]) / 312 == pytest.approx(float(t["pct_peak"]), abs=1)
        assert (r.layout.tp, r.layout.pp, r.layout.world_size) == (int(t["tp"]), int(t["pp"]), int(t["gpus"]))
        assert r.layout.global_batch == int(t["global_batch"])
        assert r.layout.recompute == "full" and r.evaluation.fits


def test_mean_error(rows):
    mean = statistics.mean(abs(r.error) for r in rows)
    assert mean <= MEAN_TARGET, f"mean |error| {100 * mean:.1f}% > {100 * MEAN_TARGET:.0f}%"


def test_worst_row(rows):
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= WORST_TARGET, (
        f"{worst.params_b}B: predicted {worst.predicted_tflops:.0f} vs published {worst.published_tflops:.0f} "
        f"TFLOP/s ({100 * worst.error:+.1f}%)"
    )


def test_trend_small_to_large(rows):
    """The paper's throughput rises from the 1.7B to the 1T model; the model must not invert that."""
    assert rows[-1].predicted_tflops > rows[0].predicted_tflops


def test_a_row_without_published_recompute_recomputes_the_fewest_blocks_that_fit():
    """Recompute "any" (not published) allows Megatron-LM's --recompute-num-layers: the count chosen per virtual
    stage fits the memory model and one block fewer does not (nor does no recompute at all)."""
    from mlm.planner.cost.calibration import RUNTIMES, fewest_recomputed
    from mlm.planner.cost.hardware import load_cluster, load_gpu
    from mlm.planner.cost.step_time import StageAssignment, balanced_blocks, evaluate
    from mlm.planner.layout import Layout

    args = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336, max_seq_len=8192)
    inputs = summarize(capture(load_model_spec("llama3-8b", args=args), seq_len=8192))
    gpu, cluster, opts = load_gpu("h100-sxm"), load_cluster("dgx-h100"), RUNTIMES["megatron-core"]
    found = {}
    for dp in (4, 8, 64):  # more optimizer sharding, fewer blocks to recompute
        layout = Layout(dp=dp, micro_batch=1, num_microbatches=4, recompute="full", zero=1)
        counts = balanced_blocks(inputs.num_blocks, 1)
        got = fewest_recomputed(inputs, layout, gpu, cluster, opts)
        assert got is not None and got[0] == layout
        k = got[1] if got[1] is not None else counts[0]
        fits = [evaluate(inputs, layout, gpu, cluster, StageAssignment(counts, (j,)), opts).fits for j in (k - 1, k)]
        assert fits == [False, True], (dp, k)
        found[dp] = k
    assert found[4] >= found[8] >= found[64] and found[4] > found[64]
    too_big = Layout(dp=2, micro_batch=1, num_microbatches=4, recompute="full", zero=1)
    assert fewest_recomputed(inputs, too_big, gpu, cluster, opts) is None  # not even recomputing every block fits
    whole = fewest_recomputed(inputs, Layout(dp=8, micro_batch=1, num_microbatches=4, recompute="full", zero=1),
                              gpu, cluster, opts, partial=False)  # fmt: skip
    assert whole is not None and whole[1] is None  # a source that recomputed every block: all of them

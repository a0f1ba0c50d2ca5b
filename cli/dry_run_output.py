"""`mlm-run PLAN --dry-run [--json]` and `mlm-plan --verify`: the dry run's measurement beside the plan's prediction."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from mlm.cli.format import gib
from mlm.planner.plan import Plan

# the dry run's categories (runtime/dry_run.py) -> the memory model's terms (plan.json stages[].memory_by_category)
MODEL_TERM = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optimizer",
    "activations": "activations",
}


def predicted_rank_memory(plan: Plan, pp_rank: int) -> tuple[float, dict[str, float]]:
    """The plan's per-GPU prediction for pipeline rank `pp_rank` (the sum over its virtual stages), without the
    reserve (allocator fragmentation, CUDA context: not tensor memory, so not in a tensor-level measurement)."""
    total, terms = 0.0, {}
    for stage in plan.stages:
        if stage.index % plan.layout.pp != pp_rank:
            continue
        total += stage.memory_bytes - stage.memory_by_category.get("reserve", 0.0)
        for key, value in stage.memory_by_category.items():
            if key != "reserve":
                terms[key] = terms.get(key, 0.0) + value
    return total, terms


def _predicted_collectives(plan: Plan, pp_rank: int) -> dict:
    per_rank = plan.predicted.collectives_per_rank if plan.predicted is not None else []
    return per_rank[pp_rank] if pp_rank < len(per_rank) else {}


def report_document(plan: Plan, reports: list[Any]) -> dict:
    """The --json document: {"ranks": [{rank, stage, measured/predicted peak, categories, collectives}]}."""
    ranks = []
    for r in reports:
        predicted, terms = predicted_rank_memory(plan, r.pp_rank)
        ranks.append(
            {
                "rank": r.rank,
                "stage": r.stages,
                "pp_rank": r.pp_rank,
                "measured_peak_memory_bytes": r.peak_memory_bytes,
                "predicted_peak_memory_bytes": predicted,
                "memory_by_category": r.memory_by_category,
                "predicted_memory_by_category": terms,
                "collectives": {k: {"count": v.count, "bytes": v.bytes} for k, v in sorted(r.collectives.items())},
                "predicted_collectives": _predicted_collectives(plan, r.pp_rank),
                "seconds": r.seconds,
                "notes": r.notes,
            }
        )
    return {"plan": plan.layout.describe(), "ranks": ranks}


def print_report(doc: dict, console: Console) -> None:
    """Memory per pipeline rank and term (measured beside predicted), then the collectives per step."""
    mem = Table(title="dry run: peak memory per GPU, reserve excluded", title_justify="left")
    for name, justify in (("rank", "left"), ("stages", "left"), ("term", "left")):
        mem.add_column(name, justify=justify)  # type: ignore[arg-type]
    for name in ("measured", "predicted", "diff"):
        mem.add_column(name, justify="right")
    for r in doc["ranks"]:
        cat, pred = r["memory_by_category"], r["predicted_memory_by_category"]
        rows = [("total", r["measured_peak_memory_bytes"], r["predicted_peak_memory_bytes"])]
        rows += [(name, cat.get(name, 0.0), pred.get(term)) for name, term in MODEL_TERM.items()]
        rows += [(name, cat[name], None) for name in ("temporaries", "pipeline_buffers", "buffers") if cat.get(name)]
        for k, (term, measured, predicted) in enumerate(rows):
            first = k == 0
            mem.add_row(
                str(r["rank"]) if first else "",
                ",".join(map(str, r["stage"])) if first else "",
                term,
                _bytes(measured),
                "-" if predicted is None else _bytes(predicted),
                f"{(measured - predicted) / predicted:+.0%}" if predicted else "",
                end_section=k == len(rows) - 1,
            )
    console.print(mem)
    comm = Table(title="dry run: collectives per step per GPU", title_justify="left")
    comm.add_column("rank")
    comm.add_column("op")
    comm.add_column("measured", justify="right")
    comm.add_column("predicted", justify="right")
    for r in doc["ranks"]:
        names = sorted(set(r["collectives"]) | set(r["predicted_collectives"]))
        for k, name in enumerate(names):
            m, p = r["collectives"].get(name), r["predicted_collectives"].get(name)
            comm.add_row(str(r["rank"]) if k == 0 else "", name, _count(m), _count(p), end_section=k == len(names) - 1)
    console.print(comm)
    seconds = max((r["seconds"] for r in doc["ranks"]), default=0.0)
    console.print(f"dry-ran {len(doc['ranks'])} rank role(s); the slowest took {seconds:.1f} s", highlight=False)
    for note in sorted({n for r in doc["ranks"] for n in r["notes"]}):
        console.print(f"note: {note}", highlight=False)


def _bytes(n: float) -> str:
    return gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(entry: dict | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['count']} × {_bytes(entry['bytes'] / max(entry['count'], 1))}"


def dry_run_command(
    plan: Plan, opts: Any, as_json: bool, console: Console, out: Console, pp_ranks: list[int] | None = None
) -> int:
    """Run the dry run on `plan` and print the comparison (or the JSON document on stdout)."""
    from mlm.runtime.dry_run import dry_run

    def progress(text: str) -> None:
        console.print(f"dry run: {text}", highlight=False)

    console.print(
        f"dry run of {plan.layout.describe()}: one step of each of "
        f"{len(pp_ranks) if pp_ranks is not None else plan.layout.pp} pipeline rank role(s) on fake tensors",
        highlight=False,
    )
    reports = dry_run(plan, opts, pp_ranks=pp_ranks, progress=progress)
    doc = report_document(plan, reports)
    if as_json:
        out.print_json(json.dumps(doc))
    else:
        print_report(doc, out)
    return 0

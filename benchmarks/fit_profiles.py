"""Fit each GPU profile's compute factor on the train rows of the published measurements, report every row.

python benchmarks/fit_profiles.py [--gpu NAME ...] [--write] [--markdown] [--leave-source-out]
python benchmarks/fit_profiles.py --fit-tp-overlap [--gpu h100-sxm]

For each GPU profile with rows in profiles/calibration/*.csv (mlm.planner.cost.calibration.read_measurements):
the factor f on the profile's prior GEMM and attention curves ([calibration] table) that minimises the mean over
sources of the mean |throughput error| on the rows marked train; then every row (train and test) predicted at f,
per source the held-out mean / worst |error|. Beside it, for each source with train rows of its own, the factor
fitted on those rows alone and the source's held-out rows at it ("own": one calibration of that software stack
carried over its other models, scales and layouts). --write puts f, the scaled curves and the held-out errors into the
profile TOML (profiles/gpus/NAME.toml); tests/test_cost_fit.py re-runs this fit and checks the file agrees.
--fit-tp-overlap: the share of tp collectives Megatron-Core's comm-GEMM overlap hides (calibration.fit_tp_overlap,
the value MEGATRON_CORE_TP_OVERLAP must hold), scored on the Megatron-Core sources' train rows at their own factors.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

from mlm.planner.cost.calibration import (
    MEGATRON_CORE_TP_OVERLAP,
    FitResult,
    RowPrediction,
    fit_gpu,
    fit_tp_overlap,
    leave_source_out,
    sources_sha256,
)
from mlm.planner.cost.hardware import list_gpus, load_gpu

GPU_DIR = Path(__file__).resolve().parent.parent / "profiles" / "gpus"


def _recompute(p: RowPrediction) -> str:
    """The row's recompute, with the blocks recomputed per stage when not all of them."""
    return p.layout.recompute if p.recomputed is None else f"{p.layout.recompute}:{p.recomputed}"


def _own_errors(res: FitResult) -> dict[tuple[str, str], float]:
    """(file, row name) -> signed error at the row's source's own factor."""
    return {(p.measurement.file, p.measurement.name): p.error for _, ps in res.own.values() for p in ps}


def print_fit(res: FitResult) -> None:
    print(f"\n== {res.gpu}: compute factor {res.factor:g} (curves = prior x factor)")
    print(
        f"{'source':<38} {'row':<26} {'split':<5} {'tp':>2} {'pp':>3} {'cp':>2} {'ep':>2} {'dp':>4} {'mb':>2} "
        f"{'vpp':>3} {'rc':<9} {'published s':>11} {'predicted s':>11} {'error':>7} {'own':>7}"
    )
    own, held_own = _own_errors(res), res.held_out(own=True)
    for p in res.predictions:
        m, lo = p.measurement, p.layout
        flag = "" if p.fits else "  (no layout fits the memory model)"
        mine = own.get((m.file, m.name))
        mine_s = f"{100 * mine:>+6.1f}%" if mine is not None else f"{'':>7}"
        print(
            f"{m.file[:-4]:<38} {m.name:<26} {m.split:<5} {lo.tp:>2} {lo.pp:>3} {lo.cp:>2} {lo.ep:>2} {lo.dp:>4} "
            f"{lo.micro_batch:>2} {lo.vpp:>3} {_recompute(p):<9} {m.published_step_s():>11.3f} "
            f"{p.predicted_step_s:>11.3f} {100 * p.error:>+6.1f}% {mine_s}{flag}"
        )
    for f in dict.fromkeys(p.measurement.file for p in res.predictions):
        for split in ("train", "test"):
            errs = [
                100 * abs(p.error) for p in res.predictions if p.measurement.file == f and p.measurement.split == split
            ]
            if errs:
                print(
                    f"  {f:<44} {split:<5} {len(errs):>2} rows  mean |error| {statistics.mean(errs):5.1f}%  "
                    f"worst {max(errs):5.1f}%"
                )
        if f in held_own:
            factor, preds = res.own[f]
            _, mean, worst = held_own[f]
            print(
                f"  {f:<44} own factor {factor:g} (its {sum(p.measurement.split == 'train' for p in preds)} train "
                f"rows): test mean |error| {mean:5.1f}%  worst {worst:5.1f}%"
            )


def markdown(res: FitResult) -> str:
    """Per-source tables (row, split, layout evaluated, published vs predicted step, error) for docs/calibration.md."""
    out = []
    own, held_own = _own_errors(res), res.held_out(own=True)
    for f in dict.fromkeys(p.measurement.file for p in res.predictions):
        preds = [p for p in res.predictions if p.measurement.file == f]
        out.append(f"\n#### {res.gpu}: `profiles/calibration/{f}` ({preds[0].measurement.source})\n")
        own_head = " own factor |" if f in res.own else ""
        out.append(
            "| row | split | tp | pp | cp | ep | dp | mb | vpp | recompute | published s | predicted s | error |"
            + own_head
        )
        rule = "| --- | --- | --: | --: | --: | --: | --: | --: | --: | --- | --: | --: | --: |"
        out.append(rule + " --: |" * bool(own_head))
        for p in preds:
            m, lo = p.measurement, p.layout
            fit = "" if p.fits else " (no layout fits the memory model)"
            mine = f" {100 * own[(m.file, m.name)]:+.1f}% |" if own_head else ""
            out.append(
                f"| {m.name} | {m.split} | {lo.tp} | {lo.pp} | {lo.cp} | {lo.ep} | {lo.dp} | {lo.micro_batch} | "
                f"{lo.vpp} | {_recompute(p)} | {m.published_step_s():.3f} | {p.predicted_step_s:.3f} | "
                f"{100 * p.error:+.1f}%{fit} |{mine}"
            )
        for split in ("train", "test"):
            errs = [100 * abs(p.error) for p in preds if p.measurement.split == split]
            if errs:
                out.append(
                    f"\n{split}: {len(errs)} rows, mean |error| {statistics.mean(errs):.1f}%, worst {max(errs):.1f}%"
                )
        if f in held_own:
            _, mean, worst = held_own[f]
            out.append(
                f"\nat the source's own factor {res.own[f][0]:g} (fitted on its train rows): test mean |error| "
                f"{mean:.1f}%, worst {worst:.1f}%"
            )
    return "\n".join(out)


def summary_markdown(fits: dict[str, FitResult]) -> str:
    """One row per (GPU, source): its source, train and test rows, and the held-out mean / worst |error| at the
    profile's factor and, where the source has train rows, at its own factor (the README's and docs' table)."""
    out = [
        "| GPU profile | source (file) | train rows | test rows | held out at the profile's factor: mean (worst) "
        "| own factor | held out at the own factor: mean (worst) |",
        "| --- | --- | --: | --: | --: | --: | --: |",
    ]
    for gpu, res in fits.items():
        held, own = res.held_out(), res.held_out(own=True)
        for f in dict.fromkeys(p.measurement.file for p in res.predictions):
            rows = [p.measurement for p in res.predictions if p.measurement.file == f]
            train = sum(m.split == "train" for m in rows)
            n, mean, worst = held[f]
            at_own = f"{own[f][1]:.1f}% ({own[f][2]:.1f}%)" if f in own else "-"
            factor = f"{res.own[f][0]:g}" if f in res.own else "-"
            out.append(
                f"| {gpu} ({res.factor:g}) | {rows[0].source} (`{f}`) | {train} | {n} | {mean:.1f}% ({worst:.1f}%) "
                f"| {factor} | {at_own} |"
            )
    return "\n".join(out)


def _fmt(xs: list[float] | tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


def write_profile(res: FitResult, sources: list[str], name: str | None = None) -> Path:
    """Scaled curves and the [calibration] numbers into the profile's TOML, comments kept (`name`: a profile of
    the same chip that takes over `res`'s factor and held-out errors)."""
    name = name or res.gpu
    path = GPU_DIR / f"{name}.toml"
    text = path.read_text()
    scaled = load_gpu(name).with_compute_factor(res.factor)
    text = _set_in_table(text, "gemm_curve", "fractions", _fmt(scaled.gemm_curve.fractions))
    text = _set_in_table(text, "attention_curve", "fractions", _fmt(scaled.attention_curve.fractions))
    if scaled.fused_attention_curve is not None:
        text = _set_in_table(text, "fused_attention_curve", "fractions", _fmt(scaled.fused_attention_curve.fractions))
    held = res.held_out()
    train = sum(1 for p in res.predictions if p.measurement.split == "train")
    values = {
        "status": '"fitted"' if name == res.gpu else '"transferred"',
        "compute_factor": f"{res.factor:g}",
        "sources": "[" + ", ".join(f'"profiles/calibration/{s}"' for s in sources) + "]",
        "train_rows": str(train),
        "test_sources": "[" + ", ".join(f'"{s}"' for s in held) + "]",
        "test_rows": "[" + ", ".join(str(n) for n, _, _ in held.values()) + "]",
        "test_mean_error_pct": "[" + ", ".join(f"{m:.1f}" for _, m, _ in held.values()) + "]",
        "test_worst_error_pct": "[" + ", ".join(f"{w:.1f}" for _, _, w in held.values()) + "]",
        "data_sha256": f'"{sources_sha256(sources)}"',
    }
    for key, v in values.items():
        text = _set_in_table(text, "calibration", key, v)
    path.write_text(text)
    return path


def _set_in_table(text: str, table: str, key: str, value: str) -> str:
    """Replace (or append) `key = value` inside [table]."""
    start = re.search(rf"^\[{re.escape(table)}\][ \t]*$", text, flags=re.M).start()  # the header, not a comment
    nxt = re.search(r"^\[", text[start + 1 :], flags=re.M)
    end = start + 1 + nxt.start() if nxt else len(text)
    body = text[start:end]
    pat = re.compile(rf"^{re.escape(key)} = .*$", flags=re.M)
    line = f"{key} = {value}"
    body = pat.sub(lambda _: line, body, count=1) if pat.search(body) else body.rstrip("\n") + f"\n{line}\n"
    return text[:start] + body + text[end:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="append", help="only these GPU profiles (default: all with data)")
    ap.add_argument("--write", action="store_true", help="write the fitted factor and errors into the TOMLs")
    ap.add_argument("--markdown", action="store_true", help="print the per-source tables as Markdown instead")
    ap.add_argument(
        "--leave-source-out",
        action="store_true",
        help="also fit without each source in turn and report that whole source at the factor the others give",
    )
    ap.add_argument(
        "--fit-tp-overlap",
        action="store_true",
        help="fit the tp overlap of the Megatron-Core runtimes (a grid, each source at its own factor) and stop",
    )
    args = ap.parse_args()
    if args.fit_tp_overlap:
        print_tp_overlap_fit(args.gpu or ["h100-sxm"])
        return
    names = args.gpu or list_gpus()
    fits: dict[str, FitResult] = {}
    tables: list[str] = []
    for name in names:
        cal = load_gpu(name).calibration
        if cal is not None and cal.status == "transferred":
            continue
        start = time.perf_counter()
        res = fit_gpu(load_gpu(name))
        if res is None:
            print(f"\n== {name}: no published rows in profiles/calibration/ (prior curves, error unknown)")
            continue
        fits[name] = res
        if args.markdown:
            tables.append(f"\n### {name}: compute factor {res.factor:g}\n" + markdown(res))
            continue
        print_fit(res)
        if args.leave_source_out:
            for src, (f, mean, worst) in leave_source_out(load_gpu(name)).items():
                print(
                    f"  leave {src} out: factor {f:g} from the others; all its rows mean {mean:.1f}% worst {worst:.1f}%"
                )
        print(f"  ({time.perf_counter() - start:.1f} s)")
        if args.write:
            print(f"  wrote {write_profile(res, _sources(res))}")
    if args.markdown:
        print(summary_markdown(fits) + "\n\n## Per-row tables\n" + "\n".join(tables))
    for name in list_gpus():  # profiles of the same chip take over the factor fitted for another
        cal = load_gpu(name).calibration
        if cal is None or cal.status != "transferred" or cal.transferred_from not in fits:
            continue
        res = fits[cal.transferred_from]
        print(f"\n== {name}: compute factor {res.factor:g} transferred from {res.gpu} (same chip)")
        if args.write:
            print(f"  wrote {write_profile(res, _sources(res), name)}")


def print_tp_overlap_fit(names: list[str]) -> None:
    """The tp_overlap grid: per value, each Megatron-Core source's own factor and train error, and their mean."""
    for name in names:
        start = time.perf_counter()
        grid = fit_tp_overlap(load_gpu(name))
        print(f"\n== {name}: tp_overlap of the Megatron-Core runtimes (train rows, each source at its own factor)")
        scores = {}
        for value, by in grid.items():
            scores[value] = sum(e for _, e in by.values()) / len(by)
            cells = "  ".join(f"{src[:-4]} factor {f:g} train {100 * e:.1f}%" for src, (f, e) in by.items())
            print(f"  tp_overlap {value:<4g}  mean train |error| {100 * scores[value]:.2f}%   {cells}")
        best = min(scores, key=lambda v: (scores[v], v))
        held = "holds it" if best == MEGATRON_CORE_TP_OVERLAP else f"holds {MEGATRON_CORE_TP_OVERLAP:g}: update it"
        print(f"  best {best:g}; calibration.MEGATRON_CORE_TP_OVERLAP {held}  ({time.perf_counter() - start:.0f} s)")


def _sources(res: FitResult) -> list[str]:
    return sorted(dict.fromkeys(p.measurement.file for p in res.predictions))


if __name__ == "__main__":
    main()

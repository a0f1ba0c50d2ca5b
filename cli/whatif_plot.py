"""The --plot chart of mlm-whatif --sweep: throughput, MFU and (with --tokens) cost against time to train."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

AXIS_LABEL = {"gpus": "GPUs", "gpu": "GPU type", "global_batch": "global batch (sequences)"}


def _si(value: float, _pos: object = None) -> str:
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:g}{suffix}"
    return f"{value:g}"


def plot_sweep(rows: list[dict[str, Any]], key: str, title: str, path: str) -> None:
    """Write a PNG: tokens/s (with ideal linear scaling for a gpus sweep), MFU, and cost vs days if known."""
    ok = [r for r in rows if r["error"] is None]
    xs = [r["num_gpus"] if key == "gpus" else r[key] for r in ok]
    categorical = key == "gpu"
    pos = list(range(len(xs))) if categorical else xs
    with_cost = any(r["cost_usd"] is not None and r["days"] is not None for r in ok)
    panels = 3 if with_cost else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), constrained_layout=True)
    fig.suptitle(title, fontsize=13)
    ax = axes[0]
    tps = [r["tokens_per_s"] for r in ok]
    if categorical:
        ax.bar(pos, tps, color="tab:blue", width=0.6)
    else:
        ax.plot(pos, tps, "o-", label="mlm prediction")
    if key == "gpus" and ok:
        ideal = [tps[0] * x / xs[0] for x in xs]
        ax.plot(pos, ideal, "--", color="grey", label=f"linear from {xs[0]} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=9)
    ax.set_xlabel(AXIS_LABEL[key])
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("scaling")
    ax.yaxis.set_major_formatter(FuncFormatter(_si))
    ax = axes[1]
    mfu = [100 * r["mfu"] for r in ok]
    if categorical:
        ax.bar(pos, mfu, color="tab:green", width=0.6)
    else:
        ax.plot(pos, mfu, "o-", color="tab:green")
    ax.set_xlabel(AXIS_LABEL[key])
    ax.set_ylabel("MFU (% of dense bf16 peak)")
    ax.set_title("model FLOPs utilisation")
    ax.set_ylim(0, 100)
    if key == "gpus":
        ax.set_xscale("log", base=2)
    for a in axes[:2]:
        a.grid(True, alpha=0.3)
        if categorical:
            a.set_xticks(pos, [str(x) for x in xs], rotation=20)
        elif key == "gpus":
            a.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 6 else 0)
            a.minorticks_off()
    if with_cost:
        ax = axes[2]
        costed = [r for r in ok if r["cost_usd"] is not None and r["days"] is not None]
        ax.plot(
            [r["days"] for r in costed], [r["cost_usd"] for r in costed], "o" if categorical else "o-", color="tab:red"
        )
        for i, r in enumerate(costed):
            label = (
                r["gpu"] if key == "gpu" else f"{r['num_gpus']} GPUs" if key == "gpus" else f"batch {r['global_batch']}"
            )
            ax.annotate(
                label,
                (r["days"], r["cost_usd"]),
                textcoords="offset points",
                xytext=(0, 8 if i % 2 == 0 else -15),
                ha="center",
                fontsize=8,
            )
        ax.margins(x=0.18, y=0.12)
        ax.set_xlabel("time to train (days)")
        ax.set_ylabel("cost (USD)")
        ax.set_title("cost vs time")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"${_si(v)}"))
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)

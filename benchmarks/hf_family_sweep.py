"""Hugging Face decoder families outside the test zoo, at tiny size: plan, dry run, and (with --parity) train.

For each family: `mlm-plan` at tp 2 (with and without sequence parallelism), `mlm-run --dry-run` of the plan, and
the dry run's collectives and peak printed beside plan.json's; with --parity, 5 steps of SGD and AdamW on 2
processes against one process (tests/test_runtime_harness.py's comparison). A family whose plan or run fails
prints the error's first line. Slow (a capture, a dry run and two trainings per family): not in the test suite.

    python benchmarks/hf_family_sweep.py [FAMILY ...] [--parity] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# gpt_bigcode with multi_query=False: its default one key/value head rules tp out (the plan says so)
FAMILIES = ("bloom", "gptj", "stablelm", "starcoder2", "cohere", "granite", "mpt", "codegen", "gpt_bigcode")


def build(family: str = "bloom") -> Any:
    """The family's causal LM at 2 layers of width 64, 4 heads (2 key/value heads where the family has them)."""
    import transformers as t

    h, layers, heads, vocab, ctx = 64, 2, 4, 128, 64
    gqa = dict(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=ctx,
    )
    made = {
        "bloom": lambda: t.BloomForCausalLM(
            t.BloomConfig(vocab_size=vocab, hidden_size=h, n_layer=layers, n_head=heads)
        ),
        "gptj": lambda: t.GPTJForCausalLM(
            t.GPTJConfig(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, rotary_dim=8, n_positions=ctx)
        ),
        "stablelm": lambda: t.StableLmForCausalLM(t.StableLmConfig(**gqa)),
        "starcoder2": lambda: t.Starcoder2ForCausalLM(t.Starcoder2Config(**gqa)),
        "cohere": lambda: t.CohereForCausalLM(t.CohereConfig(**gqa)),
        "granite": lambda: t.GraniteForCausalLM(t.GraniteConfig(**gqa)),
        "mpt": lambda: t.MptForCausalLM(t.MptConfig(vocab_size=vocab, d_model=h, n_layers=layers, n_heads=heads)),
        "codegen": lambda: t.CodeGenForCausalLM(
            t.CodeGenConfig(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, rotary_dim=8, n_positions=ctx)
        ),
        "gpt_bigcode": lambda: t.GPTBigCodeForCausalLM(
            t.GPTBigCodeConfig(
                vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=ctx, multi_query=False
            )
        ),
    }
    return made[family]()


def _cli(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"mlm.cli.{module}", *args], capture_output=True, text=True)


def _first_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "error" in ln.lower()]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "?")[:300]


def dry_run(family: str, sp: bool, work: Path) -> str:
    """One line: the plan's layout, each collective measured / priced, and the peak measured against plan.json's."""
    plan = work / f"{family}-sp{int(sp)}.json"
    argv = [__file__, "--entry", "build", "--model-arg", f"family={family}", "--seq-len", "32", "--global-batch", "8"]
    argv += ["--gpus", "2", "--tp", "2", "--pp", "1", "--sequence-parallel" if sp else "--no-sequence-parallel"]
    made = _cli("plan", *argv, "--out", str(plan))
    if made.returncode:
        return f"plan refused: {_first_error(made.stderr + made.stdout)}"
    ran = _cli("run", str(plan), "--dry-run", "--json")
    if ran.returncode:
        return f"dry run failed: {_first_error(ran.stderr + ran.stdout)}"
    rank = json.loads(ran.stdout)["ranks"][0]
    measured, priced = rank["collectives"], rank["predicted_collectives"]
    ops = []
    for op in sorted(set(measured) | set(priced)):
        got, want = measured.get(op, {}).get("count", 0), priced.get(op, {}).get("count", 0)
        ops.append(f"{op} {got}{'=' if got == want else '!='}{want}")
    peak, want = rank["measured_peak_memory_bytes"], rank["predicted_peak_memory_bytes"]
    return (
        f"{', '.join(ops)}; peak {peak / 2**20:.2f} MiB vs {want / 2**20:.2f} priced ({100 * (peak / want - 1):+.0f}%)"
    )


def parity(family: str, sp: bool, work: Path) -> str:
    """5 steps of SGD and AdamW at tp 2 against one process."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_expert_parallel import ADAMW, SGD, _compare
    from test_runtime_harness import merged, run_workers, train_runs, write_plan

    from mlm.runtime.train import RunOptions

    base = [__file__, "--entry", "build", "--model-arg", f"family={family}", "--seq-len", "32", "--global-batch", "4"]
    base += ["--micro-batch", "1", "--recompute", "none", "--pp", "1"]
    sp_flag = "--sequence-parallel" if sp else "--no-sequence-parallel"
    with contextlib.redirect_stdout(io.StringIO()):  # write_plan prints mlm-plan's report
        one = write_plan(work, f"{family}-one", [*base, "--gpus", "1"])
        two = write_plan(work, f"{family}-tp2", [*base, "--gpus", "2", "--tp", "2", sp_flag])
    still = RunOptions(steps=1, optimizer="sgd", lr=0.0, seed=0, device="cpu")
    ref = run_workers(1, train_runs, [(str(one), SGD), (str(one), ADAMW), (str(one), still)])
    got = run_workers(2, train_runs, [(str(two), SGD), (str(two), ADAMW)], timeout=300)
    for i, name in enumerate(("sgd", "adamw")):
        _compare(merged(got, i), merged(ref, i), merged(ref, 2)[1], name, f"{family} {name}")
    return "SGD and AdamW match one process (5 steps)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--parity", action="store_true", help="also train each at tp 2 against one process")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlm-families-"))
    work.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        for sp in (False, True):
            found = dry_run(family, sp, work)
            print(f"{family:<12} tp2{' sp' if sp else '   '}  {found}", flush=True)
            if not args.parity or found.startswith("plan refused"):
                continue
            try:
                line = parity(family, sp, work)
            except Exception as e:  # a family that does not train is a finding to print, not a crash
                line = f"parity failed: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}"
            print(f"{'':<12} tp2{' sp' if sp else '   '}  {line}", flush=True)


if __name__ == "__main__":
    main()

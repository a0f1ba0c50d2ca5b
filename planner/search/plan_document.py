"""Assemble plan.json's Plan from a search result (pure)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlm.planner.capture.graph import ModelIR
from mlm.planner.cost.collective_counts import rank_collectives
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs
from mlm.planner.cost.step_time import MLM_RUN, Evaluation, StageAssignment, summarize
from mlm.planner.layout import Layout
from mlm.planner.plan import ClusterRef, ModelRef, Plan, Predicted, Stage, Training

if TYPE_CHECKING:  # ModelSpec imports torch; a cache hit passes a CachedSpec instead
    from mlm.planner.capture.loader import ModelSpec


def balanced_blocks(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as even as possible, extra blocks on the middle stages (the ends hold embedding/head)."""
    base, extra = divmod(num_blocks, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


def stage_layers(ir: ModelIR, layout: Layout, assignment: StageAssignment | None) -> list[tuple[list[str], list[str]]]:
    """(layers, recompute_layers) per virtual stage: pre-block layers on the first, post-block on the last;
    under recompute, the first k blocks of each stage are recomputed (Megatron's per-stage count)."""
    names = [layer.name for layer in ir.layers]
    kinds = [layer.kind for layer in ir.layers]
    first = kinds.index("block")
    last = len(kinds) - 1 - kinds[::-1].index("block")
    # each block with the layers between it and the next block (an encoder's final norm, a decoder's embeddings),
    # which run on its stage, as the cost model prices them (inputs.summarize)
    units: list[list[str]] = []
    for name, kind in zip(names[first : last + 1], kinds[first : last + 1]):
        if kind == "block":
            units.append([name])
        else:
            units[-1].append(name)
    num_stages = layout.pp * layout.vpp
    counts = assignment.blocks_per_stage if assignment else balanced_blocks(len(units), num_stages)
    recompute = (
        assignment.recompute_blocks
        if assignment and assignment.recompute_blocks is not None
        else tuple(counts if layout.recompute != "none" else [0] * num_stages)
    )
    out = []
    pos = 0
    for i, (n, r) in enumerate(zip(counts, recompute)):
        mine = [x for unit in units[pos : pos + n] for x in unit]
        recomputed = [unit[0] for unit in units[pos : pos + r]]
        pos += n
        layers = (names[:first] if i == 0 else []) + mine + (names[last + 1 :] if i == num_stages - 1 else [])
        out.append((layers, recomputed))
    return out


def predicted_collectives(
    ir: ModelIR, layout: Layout, assignment: StageAssignment | None, inputs: ModelCostInputs | None = None
) -> list[dict]:
    """Per pipeline rank, the collectives of one step as the cost model prices them (plan.json, for the dry run).
    `inputs`: the cost inputs the layout was priced with (default: summarize(ir), Megatron's tp rule)."""
    inputs = inputs or summarize(ir)
    counts = assignment.blocks_per_stage if assignment else balanced_blocks(inputs.num_blocks, layout.pp * layout.vpp)
    params = {layer.name: layer.params for layer in ir.layers}
    kinds = {layer.name: layer.kind for layer in ir.layers}
    units = {}
    for i, (layers, _) in enumerate(stage_layers(ir, layout, assignment)):
        # one FSDP unit per parameter-holding layer (runtime/data_parallel.py), and the stage's own, which issues
        # collectives only when it holds parameters: a tied embedding whose head runs on the same stage stays in
        # it instead of being a unit (FSDP2 cannot shard one parameter twice). A tied head on a stage without its
        # embedding holds its own copy (the IR counts tied parameters once, at the embedding).
        head = any(kinds[x] == "head" for x in layers)
        embedding = next((x for x in layers if kinds[x] == "embedding" and params[x] > 0), None)
        copy = ir.tied_embeddings and head and embedding is None
        units[i] = sum(1 for x in layers if params.get(x, 0) > 0) + (1 if copy else 0)
    out = []
    for rank in range(layout.pp):
        ops = rank_collectives(
            inputs,
            layout,
            counts,
            rank,
            MLM_RUN.grad_reduce_bytes,
            MLM_RUN.zero3_reduce_every_microbatch,
            units,
            assignment.recompute_blocks if assignment else None,
            MLM_RUN.expert_tensor_parallel,
        )
        out.append({op: {"count": c.count, "bytes": c.bytes} for op, c in sorted(ops.items())})
    return out


def build_plan(
    spec: ModelSpec,
    ir: ModelIR,
    layout: Layout,
    evaluation: Evaluation,
    assignment: StageAssignment | None,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    tensor_parallel: dict[str, str],
    alternatives: list[dict[str, object]],
    inputs: ModelCostInputs | None = None,
) -> Plan:
    stages = []
    for i, ((layers, rc), cost) in enumerate(zip(stage_layers(ir, layout, assignment), evaluation.stages)):
        stages.append(
            Stage(
                index=i,
                layers=layers,
                recompute_layers=rc,
                memory_bytes=float(cost.memory.total),
                time_s=float(cost.time_s),
                memory_by_category={
                    "params": float(cost.memory.params),
                    "grads": float(cost.memory.grads),
                    "optimizer": float(cost.memory.optimizer),
                    "activations": float(cost.memory.activations),
                    "reserve": float(cost.memory.reserve),
                },
            )
        )
    return Plan(
        model=ModelRef(
            source=spec.source,
            sha256=spec.sha256,
            entry=spec.entry,
            args=dict(spec.args),
            num_params=ir.num_params,
            num_layers=ir.num_layers,
            hidden_size=ir.hidden_size,
            num_heads=ir.num_heads,
            vocab_size=ir.vocab_size,
        ),
        cluster=ClusterRef(
            gpu=gpu.name,
            num_gpus=layout.world_size,
            gpus_per_node=cluster.gpus_per_node,
            profile={"gpu": gpu.to_dict(), "cluster": cluster.to_dict()},
        ),
        training=Training(
            global_batch=layout.global_batch,
            seq_len=ir.seq_len,
            dtype=gpu.compute_dtype,
            token_inputs=ir.token_inputs,
        ),
        layout=layout,
        stages=stages,
        tensor_parallel=tensor_parallel,
        predicted=Predicted(
            step_time_s=evaluation.step_time_s,
            tokens_per_s=evaluation.tokens_per_s,
            model_tflops_per_gpu=evaluation.model_tflops_per_gpu,
            mfu=evaluation.mfu,
            peak_memory_bytes=float(evaluation.peak_memory_bytes),
            breakdown={k: float(v) for k, v in evaluation.breakdown.items()},
            collectives_per_rank=predicted_collectives(ir, layout, assignment, inputs),
        ),
        alternatives=alternatives,
    )

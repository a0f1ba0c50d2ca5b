"""plan.json: the versioned document the planner writes and the runtime reads (fields in shared/DESIGN.md).

Plain JSON, validated field by field on load; nothing in it is ever executed. Stages are listed in pipeline order;
with vpp > 1 there are pp*vpp stages (virtual stages) and stage i runs on pipeline rank i % pp, the placement of
torch.distributed.pipelining's interleaved schedules.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlm.planner.errors import PlanFileError
from mlm.planner.layout import RECOMPUTE_CHOICES, ZERO_CHOICES, Layout

SCHEMA_VERSION = 1
TP_STYLES = ("colwise", "rowwise", "vocab", "sequence", "heads", "rows", "replicate")


@dataclass(frozen=True)
class ModelRef:
    source: str  # a path to the model file, or "preset:<name>"
    sha256: str  # of the model file's bytes
    entry: str  # factory name
    args: dict[str, Any]
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int


@dataclass(frozen=True)
class ClusterRef:
    gpu: str
    num_gpus: int
    gpus_per_node: int
    profile: dict[str, Any]  # the resolved GPU and cluster profile values used


@dataclass(frozen=True)
class Training:
    global_batch: int  # samples (sequences) per step
    seq_len: int  # tokens per sample; for inputs that are not token sequences, the tokens its attention sees, or 1
    dtype: str = "bf16"
    token_inputs: bool = True  # False: the model's inputs (images, latents) are not shaped by seq_len


@dataclass(frozen=True)
class Stage:
    index: int
    layers: list[str]  # layer FQNs of the IR in execution order ("loss" for the loss computation)
    recompute_layers: list[str]  # the subset of `layers` whose activations are recomputed
    memory_bytes: float = 0.0
    time_s: float = 0.0
    # memory_bytes by term (params, grads, optimizer, activations, reserve), as the memory model prices it; the
    # dry run (mlm-run --dry-run) compares its measurement with these
    memory_by_category: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    breakdown: dict[str, float]
    # per pipeline rank: {op: {"count", "bytes"}} per step as the cost model prices it (cost/collective_counts.py)
    collectives_per_rank: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: ClusterRef
    training: Training
    layout: Layout
    stages: list[Stage]
    tensor_parallel: dict[str, str]
    predicted: Predicted | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)  # layout field names the user pinned (each holds in layout)
    warnings: list[str] = field(default_factory=list)  # every assumption of capture and search, one sentence each
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan.to_json() + "\n")


def load_plan(path: str | Path) -> Plan:
    """Read and validate plan.json; raises PlanFileError naming the bad field."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanFileError(f"cannot read plan {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PlanFileError(f"{path} is not a plan.json (not UTF-8 text: byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return plan_from_dict(data)


def plan_from_dict(data: Any) -> Plan:
    """Validate a decoded plan.json document and build the Plan."""
    _expect(isinstance(data, dict), "plan", "must be a JSON object")
    version = _get(data, "schema_version", int, "plan")
    _expect(
        version == SCHEMA_VERSION, "schema_version", f"is {version}; this mlm reads schema_version {SCHEMA_VERSION}"
    )
    model = _build(ModelRef, _get(data, "model", dict, "plan"), "model")
    cluster = _build(ClusterRef, _get(data, "cluster", dict, "plan"), "cluster")
    training = _build(Training, _get(data, "training", dict, "plan"), "training")
    layout = _build(Layout, _get(data, "layout", dict, "plan"), "layout")
    _check_layout(layout)
    stages_raw = _get(data, "stages", list, "plan")
    stages = [_build(Stage, s, f"stages[{i}]") for i, s in enumerate(stages_raw)]
    _expect(
        len(stages) == layout.pp * layout.vpp,
        "stages",
        f"has {len(stages)} entries; layout pp*vpp = {layout.pp * layout.vpp}",
    )
    for i, s in enumerate(stages):
        _expect(s.index == i, f"stages[{i}].index", f"is {s.index}, expected {i}")
        _expect(all(isinstance(x, str) for x in s.layers), f"stages[{i}].layers", "must be a list of strings")
        _expect(
            set(s.recompute_layers) <= set(s.layers),
            f"stages[{i}].recompute_layers",
            "names layers the stage does not hold",
        )
    tp = _get(data, "tensor_parallel", dict, "plan")
    for k, v in tp.items():
        _expect(v in TP_STYLES, f"tensor_parallel[{k!r}]", f"is {v!r}; expected one of {', '.join(TP_STYLES)}")
    pred_raw = data.get("predicted")
    predicted = None if pred_raw is None else _build(Predicted, pred_raw, "predicted")
    alternatives = data.get("alternatives", [])
    _expect(isinstance(alternatives, list), "alternatives", "must be a list")
    pinned = _strings(data, "pinned")  # absent in plans written before these fields: nothing pinned, no warnings
    layout_fields = {f.name for f in dataclasses.fields(Layout)}
    for name in pinned:
        _expect(name in layout_fields, "pinned", f"names {name!r}, which is not a layout field")
    warnings = _strings(data, "warnings")
    _expect(
        training.global_batch == layout.global_batch,
        "training.global_batch",
        f"is {training.global_batch} but micro_batch*num_microbatches*dp = {layout.global_batch}",
    )
    _expect(
        cluster.num_gpus == layout.world_size,
        "cluster.num_gpus",
        f"is {cluster.num_gpus} but the layout uses {layout.world_size}",
    )
    return Plan(
        model=model,
        cluster=cluster,
        training=training,
        layout=layout,
        stages=stages,
        tensor_parallel=dict(tp),
        predicted=predicted,
        alternatives=alternatives,
        pinned=pinned,
        warnings=warnings,
        schema_version=version,
    )


def _strings(data: dict, key: str) -> list[str]:
    """An optional list of strings (empty when absent)."""
    value = data.get(key, [])
    _expect(isinstance(value, list) and all(isinstance(x, str) for x in value), key, "must be a list of strings")
    return list(value)


def _check_layout(layout: Layout) -> None:
    for name in ("tp", "pp", "dp", "cp", "micro_batch", "num_microbatches", "vpp"):
        _expect(getattr(layout, name) >= 1, f"layout.{name}", "must be >= 1")
    _expect(
        layout.recompute in RECOMPUTE_CHOICES,
        "layout.recompute",
        f"is {layout.recompute!r}; expected one of {', '.join(RECOMPUTE_CHOICES)}",
    )
    _expect(layout.zero in ZERO_CHOICES, "layout.zero", f"is {layout.zero}; expected one of {ZERO_CHOICES}")


_TYPES: dict[str, Any] = {
    "int": int,
    "float": (int, float),
    "str": str,
    "bool": bool,
    "dict[str, Any]": dict,
    "dict[str, float]": dict,
    "dict[str, str]": dict,
    "list[str]": list,
    "list[Any]": list,
    "Recompute": str,
}


def _build(cls: type, raw: Any, where: str) -> Any:
    """Construct dataclass `cls` from a dict, checking that every field is present and of the right type."""
    _expect(isinstance(raw, dict), where, "must be a JSON object")
    kwargs = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.name not in raw:
            _expect(has_default, f"{where}.{f.name}", "is missing")
            continue
        value = raw[f.name]
        expected = _TYPES.get(str(f.type), object)
        ok = isinstance(value, expected) and not (expected in (int, (int, float)) and isinstance(value, bool))
        _expect(ok, f"{where}.{f.name}", f"has type {type(value).__name__}, expected {f.type}")
        kwargs[f.name] = value
    unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
    _expect(not unknown, where, f"has unknown field(s) {', '.join(sorted(unknown))}")
    return cls(**kwargs)


def _get(data: dict, key: str, typ: type, where: str) -> Any:
    _expect(key in data, f"{key}" if where == "plan" else f"{where}.{key}", "is missing")
    value = data[key]
    _expect(
        isinstance(value, typ) and not (typ is int and isinstance(value, bool)),
        key,
        f"has type {type(value).__name__}, expected {typ.__name__}",
    )
    return value


def _expect(cond: bool, fieldname: str, problem: str) -> None:
    if not cond:
        raise PlanFileError(f"plan.json: field {fieldname} {problem}")

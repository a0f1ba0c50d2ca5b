"""GPU and cluster profiles: frozen dataclasses loaded from TOML (presets in the mlm.profiles package, or a path).

Pure: no torch. Hardware numbers live only in profiles/gpus/*.toml and profiles/clusters/*.toml; this module knows
the key sets, checks them strictly, and interpolates the efficiency curves for the cost model.

Conventions the curves use (the TOML files say the same):
  - GEMM size is the geometric mean of m, n, k: `gemm_size(m, n, k) = (m*n*k) ** (1/3)`.
  - Attention efficiency is for causal F.scaled_dot_product_attention, forward + backward, with FLOPs counted as
    7*b*h*s^2*d (forward 2*b*h*s^2*d after the causal halving, backward 2.5x forward), over the dense bf16 peak.
  - Curves are piecewise linear in log(x), clamped at both ends.

A reference to a profile is a preset name ("h100-sxm") or a path to a .toml file (anything ending in .toml or
containing a path separator). A path inside a file (a GPU's default_cluster, a cluster's gpu) is relative to that file.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import tomllib

from mlm.planner.errors import PlanError

DEFAULT_GPU = "a100-80gb"  # names, not hardware numbers: the numbers are in the TOML files
_PACKAGE = "mlm.profiles"
_GPU_DIR = "gpus"
_CLUSTER_DIR = "clusters"


def _interp_log(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation of ys over log(xs) at x, clamped to the end values."""
    assert len(xs) == len(ys) >= 1 and x > 0
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log(x)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = math.log(xs[i - 1]), math.log(xs[i])
            t = (lx - x0) / (x1 - x0)
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def gemm_size(m: int, n: int, k: int) -> float:
    """The size a GEMM curve is indexed by: the geometric mean of m, n and k."""
    return float(m * n * k) ** (1.0 / 3.0)


@dataclass(frozen=True)
class GemmCurve:
    """Achieved fraction of dense peak for a GEMM of a given size (geometric mean of m, n, k)."""

    sizes: tuple[float, ...]
    fractions: tuple[float, ...]


@dataclass(frozen=True)
class AttentionCurve:
    """Achieved fraction of dense bf16 peak for causal attention (fwd+bwd) at a given sequence length."""

    seq_lens: tuple[float, ...]
    fractions: tuple[float, ...]


@dataclass(frozen=True)
class Calibration:
    """How a GPU profile's efficiency curves were obtained, and how wrong they are on data they were not fitted on.

    status: "fitted" (curves = prior x compute_factor, the factor fitted by `method` on the train rows of
    `sources`), "transferred" (factor fitted for another profile of the same chip) or "prior" (never fitted).
    The per-source lists are aligned with `test_sources`: held-out rows, their mean and worst |error| in percent.
    """

    status: str
    method: str
    fitted: str
    compute_factor: float
    prior_gemm_fractions: tuple[float, ...]
    prior_attention_fractions: tuple[float, ...]
    # the fused attention kernel's prior (GPUProfile.fused_attention_curve), empty where the profile has none
    prior_fused_attention_fractions: tuple[float, ...] = ()
    # the published kernel benchmark (profiles/kernels/) the prior attention curves are derived from, if any
    prior_attention_source: str = ""
    sources: tuple[str, ...] = ()
    transferred_from: str = ""  # status "transferred": the profile whose factor (and held-out errors) this copies
    data_sha256: str = ""  # of the source files the fit read (calibration.sources_sha256): stale when they change
    train_rows: int = 0
    test_sources: tuple[str, ...] = ()
    test_rows: tuple[int, ...] = ()
    test_mean_error_pct: tuple[float, ...] = ()
    test_worst_error_pct: tuple[float, ...] = ()

    def summary(self) -> str:
        """One line for plan output: status, and the out-of-sample error per source."""
        if self.status == "prior" or not self.test_sources:
            return f"{self.status}: {self.fitted}"
        held = "; ".join(
            f"{s} {n} rows mean {m:.1f}% worst {w:.1f}%"
            for s, n, m, w in zip(
                self.test_sources, self.test_rows, self.test_mean_error_pct, self.test_worst_error_pct
            )
        )
        origin = f" from {self.transferred_from}" if self.transferred_from else ""
        return f"{self.status}{origin} (factor {self.compute_factor:g} on {self.train_rows} rows); held out: {held}"


_CAL_STATUS = ("fitted", "transferred", "prior")
COMPUTE_DTYPES = {"bf16": 2, "fp32": 4}  # GPUProfile.compute_dtype -> bytes per element


def _build_calibration(data: Any, source: str) -> Calibration:
    """Validate a [calibration] table (its own key set: lists of strings and integers are allowed here)."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: 'calibration' must be a table, got {data!r}")
    hints = get_type_hints(Calibration)
    fields_ = {f.name: f for f in dataclasses.fields(Calibration)}
    for key in data:
        if key not in fields_:
            raise PlanError(f"{source}: unknown key 'calibration.{key}' (expected: {', '.join(fields_)})")
    values: dict[str, Any] = {}
    for key, f in fields_.items():
        if key not in data:
            if f.default is dataclasses.MISSING:
                raise PlanError(f"{source}: missing key 'calibration.{key}'")
            continue
        v, hint, where = data[key], hints[key], f"{source}: key 'calibration.{key}'"
        if hint is str:
            if not isinstance(v, str) or (not v and f.default is dataclasses.MISSING):
                raise PlanError(f"{where} must be a non-empty string, got {v!r}")
        elif hint is int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"{where} must be a non-negative integer, got {v!r}")
        elif hint is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PlanError(f"{where} must be a positive number, got {v!r}")
            v = float(v)
        else:
            item = hint.__args__[0]
            ok = isinstance(v, list) and all(
                isinstance(x, str) if item is str else not isinstance(x, bool) and isinstance(x, (int, float))
                for x in v
            )
            if not ok or (item is int and any(not isinstance(x, int) or x < 0 for x in v)):
                raise PlanError(f"{where} must be an array of {item.__name__}, got {v!r}")
            v = tuple(float(x) if item is float else x for x in v)
        values[key] = v
    cal = Calibration(**values)
    if cal.status not in _CAL_STATUS:
        raise PlanError(f"{source}: calibration.status must be one of {', '.join(_CAL_STATUS)}, got {cal.status!r}")
    n = len(cal.test_sources)
    if not len(cal.test_rows) == len(cal.test_mean_error_pct) == len(cal.test_worst_error_pct) == n:
        raise PlanError(f"{source}: calibration.test_* arrays must all have one entry per test source")
    return cal


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator. Rates are dense (no sparsity); link bandwidths are per direction."""

    name: str
    bf16_tflops: float
    fp16_tflops: float
    fp32_tflops: float  # non-tensor-core FP32
    tf32_tflops: float
    hbm_gib: float
    hbm_gbps: float
    nvlink_gbps: float  # per GPU, one direction
    usd_per_gpu_hour: float
    default_cluster: str  # a cluster preset name or a .toml path relative to this file
    memory_bound_efficiency: float  # fraction of hbm_gbps reached by elementwise ops
    gemm_curve: GemmCurve
    attention_curve: AttentionCurve
    calibration: Calibration | None = None  # how the curves were fitted and their out-of-sample error
    # causal attention fwd+bwd in a fused kernel faster than the SDPA FlashAttention-2 that attention_curve
    # describes: cuDNN's fused attention, which TransformerEngine's DotProductAttention picks over flash-attn on
    # Hopper and later (CostOptions.fused_attention). Absent: such stacks run the attention_curve kernel here.
    fused_attention_curve: AttentionCurve | None = None
    # the dtype mlm-run computes in on this device, which the plan prices (bytes of activations, of the compute copy
    # of the weights, of tp/pp traffic): "bf16" (mixed precision, as on every GPU), or "fp32" (a CPU profile
    # written by mlm-profile: mlm-run computes in fp32 there, and *_tflops hold the measured fp32 rate)
    compute_dtype: str = "bf16"

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return COMPUTE_DTYPES[self.compute_dtype]

    def gemm_efficiency(self, size: float) -> float:
        """Fraction of dense peak a GEMM of `size` (see gemm_size) reaches; clamped at the curve's ends."""
        return _interp_log(self.gemm_curve.sizes, self.gemm_curve.fractions, max(float(size), 1e-9))

    def attention_efficiency(self, seq_len: float, fused: bool = False) -> float:
        """Fraction of dense bf16 peak causal attention (fwd+bwd) reaches at `seq_len`, clamped at the ends (fused:
        in the fused kernel of fused_attention_curve, where the profile has one)."""
        c = self.fused_attention_curve if fused and self.fused_attention_curve is not None else self.attention_curve
        return _interp_log(c.seq_lens, c.fractions, max(float(seq_len), 1e-9))

    def with_compute_factor(self, factor: float) -> GPUProfile:
        """This profile with every efficiency curve = its prior curve ([calibration]) x `factor`, held at 1."""
        cal = self.calibration
        assert cal is not None, f"{self.name}: no [calibration] table with the prior curves"

        def scaled(prior: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(min(1.0, f * factor) for f in prior)

        fused = self.fused_attention_curve
        return dataclasses.replace(
            self,
            gemm_curve=dataclasses.replace(self.gemm_curve, fractions=scaled(cal.prior_gemm_fractions)),
            attention_curve=dataclasses.replace(self.attention_curve, fractions=scaled(cal.prior_attention_fractions)),
            fused_attention_curve=None
            if fused is None
            else dataclasses.replace(fused, fractions=scaled(cal.prior_fused_attention_fractions)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The TOML document as plain JSON-ready values (for plan.json's cluster.profile)."""
        return _as_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> GPUProfile:
        """Validate `data` against the strict key set; `source` names the file in error messages."""
        return _build(cls, data, source)


@dataclass(frozen=True)
class ClusterProfile:
    """A node type and its network. Bandwidths are per GPU, one direction; latency is per collective call."""

    name: str
    gpu: str  # default GPU: a preset name or a .toml path relative to this file
    gpus_per_node: int
    intra_node_gbps: float
    intra_node_latency_us: float
    intra_node_collective_efficiency: float  # NCCL bus bandwidth / intra_node_gbps
    inter_node_gbps: float
    inter_node_latency_us: float
    inter_node_collective_efficiency: float  # NCCL bus bandwidth / inter_node_gbps
    memory_reserve_gib: float  # per GPU: CUDA context, NCCL buffers, workspaces, fragmentation
    # per ring step (NCCL's hwLat), added to the per-call latency once per step; 0 when not known (a measured
    # profile's per-call latency then stands for the whole collective)
    intra_node_step_latency_us: float = 0.0
    inter_node_step_latency_us: float = 0.0
    # fraction of a collective's time that can run hidden under concurrent compute on this machine (1: the
    # collective runs on resources of its own, as NCCL's stream beside the compute; 0: the two share them, as gloo's
    # threads and the compute share a few CPU cores). It scales every overlap CostOptions allows. mlm-profile
    # measures it: an async all-reduce beside a GEMM loop of the same length.
    collective_overlap_efficiency: float = 1.0
    # a reduce-scatter's bus bandwidth over the all-reduce's and all-gather's (1 with NCCL, whose reduce-scatter is a
    # ring like its all-gather; gloo's on a CPU took longer than its all-reduce of the same buffer). mlm-profile
    # measures it.
    reduce_scatter_efficiency: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        """The TOML document as plain JSON-ready values."""
        return _as_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> ClusterProfile:
        """Validate `data` against the strict key set; `source` names the file in error messages."""
        return _build(cls, data, source)


# ---- strict validation -------------------------------------------------------------------------------------------

_NONNEGATIVE = {
    "usd_per_gpu_hour",
    "intra_node_step_latency_us",
    "inter_node_step_latency_us",
    "collective_overlap_efficiency",
}


def _check_value(source: str, key: str, hint: Any, value: Any) -> Any:
    """Coerce one TOML value to the field's type, or raise PlanError naming the file and key."""
    if hint is str:
        if not isinstance(value, str) or not value:
            raise PlanError(f"{source}: key '{key}' must be a non-empty string, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{source}: key '{key}' must be a positive integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PlanError(f"{source}: key '{key}' must be a number, got {value!r}")
        low_ok = value >= 0 if key in _NONNEGATIVE else value > 0
        if not low_ok or (key.endswith("efficiency") and value > 1):
            bound = ">= 0" if key in _NONNEGATIVE else "in (0, 1]" if key.endswith("efficiency") else "> 0"
            raise PlanError(f"{source}: key '{key}' must be {bound}, got {value!r}")
        return float(value)
    assert hint == tuple[float, ...], hint
    if not isinstance(value, list) or not value:
        raise PlanError(f"{source}: key '{key}' must be a non-empty array of numbers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise PlanError(f"{source}: key '{key}' must hold positive numbers, got {v!r}")
        if key.endswith("fractions") and v > 1:
            raise PlanError(f"{source}: key '{key}' holds {v!r}; fractions must be in (0, 1]")
        out.append(float(v))
    return tuple(out)


def _build(cls: type, data: Any, source: str, prefix: str = "") -> Any:
    """Build dataclass `cls` from a TOML table, rejecting unknown and missing keys."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: '{prefix.rstrip('.')}' must be a table, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in hints:
            raise PlanError(f"{source}: unknown key '{prefix}{key}' (expected: {', '.join(names)})")
    values: dict[str, Any] = {}
    defaults = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for key in names:
        if key not in data:
            if key in defaults:
                continue
            raise PlanError(f"{source}: missing key '{prefix}{key}'")
        hint = hints[key]
        if key == "calibration":
            values[key] = None if data[key] is None else _build_calibration(data[key], source)
        elif key == "fused_attention_curve":
            values[key] = None if data[key] is None else _build(AttentionCurve, data[key], source, f"{prefix}{key}.")
        elif dataclasses.is_dataclass(hint):
            values[key] = _build(hint, data[key], source, f"{prefix}{key}.")
        else:
            values[key] = _check_value(source, prefix + key, hint, data[key])
    if values.get("compute_dtype", "bf16") not in COMPUTE_DTYPES:
        raise PlanError(
            f"{source}: key 'compute_dtype' must be one of {', '.join(COMPUTE_DTYPES)}, got {values['compute_dtype']!r}"
        )
    if cls in (GemmCurve, AttentionCurve):
        xs, ys = values[names[0]], values["fractions"]
        if len(xs) != len(ys):
            raise PlanError(f"{source}: '{prefix}{names[0]}' and '{prefix}fractions' differ in length")
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise PlanError(f"{source}: '{prefix}{names[0]}' must be strictly increasing, got {list(xs)}")
    if cls is GPUProfile and values.get("calibration") is not None:
        cal, fused = values["calibration"], values.get("fused_attention_curve")
        for key, prior, curve in (
            ("prior_gemm_fractions", cal.prior_gemm_fractions, values["gemm_curve"]),
            ("prior_attention_fractions", cal.prior_attention_fractions, values["attention_curve"]),
            ("prior_fused_attention_fractions", cal.prior_fused_attention_fractions, fused),
        ):
            if len(prior) != (0 if curve is None else len(curve.fractions)):
                raise PlanError(f"{source}: 'calibration.{key}' must have one entry per point of its curve")
    return cls(**values)


def _as_dict(obj: Any) -> dict[str, Any]:
    """Dataclass to nested dict with lists instead of tuples."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:  # an optional table that is absent (an uncalibrated, e.g. measured, profile)
            continue
        out[f.name] = _as_dict(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
    return out


# ---- loading -----------------------------------------------------------------------------------------------------


def _is_path(ref: str) -> bool:
    return ref.endswith(".toml") or "/" in ref or "\\" in ref


def _preset_names(folder: str) -> list[str]:
    root = importlib.resources.files(_PACKAGE) / folder
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def list_gpus() -> list[str]:
    """Names of the GPU presets shipped in mlm.profiles/gpus."""
    return _preset_names(_GPU_DIR)


def list_clusters() -> list[str]:
    """Names of the cluster presets shipped in mlm.profiles/clusters."""
    return _preset_names(_CLUSTER_DIR)


def _read(kind: str, folder: str, ref: str, base: Path | None) -> tuple[dict[str, Any], str, Path | None]:
    """TOML contents, a source label for messages, and the folder relative references resolve against."""
    if _is_path(ref):
        path = Path(ref).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        if not path.is_file():
            raise PlanError(f"{kind} profile file '{path}' not found")
        text, source, folder_of = path.read_text(encoding="utf-8"), str(path), path.parent
    else:
        names = _preset_names(folder)
        if ref not in names:
            raise PlanError(f"unknown {kind} profile '{ref}'; available: {', '.join(names)} (or a .toml file path)")
        res = importlib.resources.files(_PACKAGE) / folder / f"{ref}.toml"
        text, source, folder_of = res.read_text(encoding="utf-8"), f"{_PACKAGE}/{folder}/{ref}.toml", None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{source}: invalid TOML: {e}") from None
    return data, source, folder_of


_P = TypeVar("_P", GPUProfile, ClusterProfile)


def _load_at(cls: type[_P], ref: str, base: Path | None) -> tuple[_P, Path | None]:
    """Load and validate one profile; presets must be named after their file."""
    kind, folder = ("GPU", _GPU_DIR) if cls is GPUProfile else ("cluster", _CLUSTER_DIR)
    data, source, folder_of = _read(kind, folder, ref, base)
    profile = cls.from_dict(data, source)
    if not _is_path(ref) and profile.name != ref:
        raise PlanError(f"{source}: name must be '{ref}' (the file's stem), got '{profile.name}'")
    return profile, folder_of


def _load_gpu_at(ref: str, base: Path | None) -> tuple[GPUProfile, Path | None]:
    return _load_at(GPUProfile, ref, base)


def _load_cluster_at(ref: str, base: Path | None) -> tuple[ClusterProfile, Path | None]:
    return _load_at(ClusterProfile, ref, base)


def load_gpu(name_or_path: str) -> GPUProfile:
    """A GPU preset by name (see list_gpus) or a GPU profile TOML file, e.g. one written by mlm-profile."""
    return _load_gpu_at(name_or_path, None)[0]


def load_cluster(name_or_path: str) -> ClusterProfile:
    """A cluster preset by name (see list_clusters) or a cluster profile TOML file."""
    return _load_cluster_at(name_or_path, None)[0]


def resolve(gpu: str | None, cluster: str | None) -> tuple[GPUProfile, ClusterProfile]:
    """The GPU and cluster a plan uses.

    gpu picks the GPU and, unless cluster is given, its default_cluster; cluster alone picks the cluster and its
    default gpu; neither gives DEFAULT_GPU on its default cluster (a100-80gb on dgx-a100).
    """
    if gpu is None and cluster is not None:
        c, c_dir = _load_cluster_at(cluster, None)
        return _load_gpu_at(c.gpu, c_dir)[0], c
    g, g_dir = _load_gpu_at(gpu if gpu is not None else DEFAULT_GPU, None)
    if cluster is not None:
        return g, _load_cluster_at(cluster, None)[0]
    try:
        return g, _load_cluster_at(g.default_cluster, g_dir)[0]
    except PlanError as e:
        raise PlanError(f"GPU profile '{g.name}': default_cluster: {e}; pass --cluster NAME|PATH") from None


# ---- writing (used by mlm-profile) -------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        assert math.isfinite(v), v
        return repr(v)
    assert isinstance(v, (list, tuple)), v
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def to_toml(profile: GPUProfile | ClusterProfile, comments: dict[str, str] | None = None, header: str = "") -> str:
    """The profile as a TOML document in its strict key set; `comments` adds `# ...` after a key (dotted for tables)."""
    comments = comments or {}
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    tables: list[str] = []
    for key, value in profile.to_dict().items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append("")
            tables.append(f"[{key}]" + (f"  # {comments[key]}" if key in comments else ""))
            for sub, v in value.items():
                note = comments.get(f"{key}.{sub}")
                tables.append(f"{sub} = {_toml_value(v)}" + (f"  # {note}" if note else ""))
        else:
            note = comments.get(key)
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines + tables) + "\n"

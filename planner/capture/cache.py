"""On-disk cache of capture results, so a repeat mlm-plan neither traces the model nor imports torch.

Capturing GPT-3 175B takes seconds and importing torch alone about 2 s on a small machine; the search after it
needs only the ModelIR. An entry is keyed by everything the IR depends on: the bytes of the model file and of the
.py files beside it (a model may import its siblings; for presets, the preset folder), the requested entry, the
--model-arg strings, the sequence length, the capture method, the compute dtype, the source of mlm's capture code,
and the versions of mlm, torch and transformers (read from package metadata, without importing them). The key is
computed without importing torch or the loader; only a miss imports them.

An entry is a pickle with a format version, holding the ModelIR (any fields it has; a change to the capture code
changes the key) and the few ModelSpec fields the planner reads. Unpickling refuses torch classes, so a hit never
imports torch; an entry that cannot be read is ignored and rebuilt. Directory: $MLM_CACHE_DIR, else
$XDG_CACHE_HOME/mlm, else ~/.cache/mlm.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.presets.registry import PRESETS, Preset

FORMAT_VERSION = 1  # bump when the entry layout below changes
PRESET_PREFIX = "preset:"  # as loader.PRESET_PREFIX (not imported: loader imports torch)
_CAPTURE_DIR = Path(__file__).resolve().parent
_VERSIONED = ("mlm", "torch", "transformers", "diffusers", "networkx")  # packages whose version can change a capture
_ALLOWED_MODULES = ("builtins", "collections", "copyreg", "networkx", "mlm.", "pathlib", "_codecs")


@dataclass(frozen=True)
class CachedSpec:
    """The ModelSpec fields the planner reads (source, hash, entry, args, preset), stored beside the IR.

    Duck-types loader.ModelSpec for the search and plan.json; it has no module (nothing on a hit runs user code)."""

    source: str
    path: Path
    sha256: str
    entry: str
    args: dict[str, Any] = field(default_factory=dict)
    preset_name: str | None = None

    @property
    def preset(self) -> Preset | None:
        return PRESETS.get(self.preset_name) if self.preset_name else None

    @property
    def display_name(self) -> str:
        return self.source[len(PRESET_PREFIX) :] if self.source.startswith(PRESET_PREFIX) else self.path.name

    @classmethod
    def of(cls, spec: Any) -> CachedSpec:
        """From a loader.ModelSpec."""
        preset = spec.source[len(PRESET_PREFIX) :] if spec.source.startswith(PRESET_PREFIX) else None
        return cls(spec.source, Path(spec.path), spec.sha256, spec.entry, dict(spec.args), preset)


def cache_dir() -> Path:
    if env := os.environ.get("MLM_CACHE_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mlm"
    return Path.home() / ".cache" / "mlm"


def model_file(model: str) -> Path | None:
    """The file MODEL names, resolved as load_model_spec does (a file wins over a preset name); None if neither."""
    name = model[len(PRESET_PREFIX) :] if model.startswith(PRESET_PREFIX) else model
    if name in PRESETS and not Path(model).is_file():
        return _CAPTURE_DIR / "presets" / PRESETS[name].file
    path = Path(model)
    return path.resolve() if path.is_file() else None


def capture_key(
    model: str, entry: str | None, model_args: list[str], seq_len: int | None, method: str, dtype: str = "bf16"
) -> str | None:
    """The cache key of one capture request (`dtype`: the compute dtype captured in), or None when MODEL is not a
    readable file (the loader then says why)."""
    path = model_file(model)
    if path is None:
        return None
    try:
        parts = {
            "format": FORMAT_VERSION,
            "model": model,
            "file": _sha256(path.read_bytes()),
            "siblings": _folder_hash(path.parent),
            "entry": entry,
            "model_args": list(model_args),
            "seq_len": seq_len,
            "method": method,
            "dtype": dtype,
            "capture_code": _folder_hash(_CAPTURE_DIR),
            "versions": {name: _version(name) for name in _VERSIONED},
        }
    except OSError:
        return None
    return _sha256(json.dumps(parts, sort_keys=True).encode())


def load(key: str) -> tuple[CachedSpec, ModelIR] | None:
    """The cached (spec, IR) for `key`, or None on a miss or an entry that cannot be read (it is rebuilt)."""
    try:
        data = _entry_path(key).read_bytes()
        entry = _SafeUnpickler(io.BytesIO(data)).load()
        if not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION or entry.get("key") != key:
            return None
        spec, ir = entry["spec"], entry["ir"]
        if not isinstance(spec, CachedSpec) or not isinstance(ir, ModelIR):
            return None
        return spec, ir
    except Exception:  # a missing, truncated, foreign or stale entry is a miss, never an error
        return None


def store(key: str, spec: Any, ir: ModelIR) -> None:
    """Write the entry atomically (temp file + rename); a cache that cannot be written is skipped silently."""
    target = _entry_path(key)
    entry = {"format": FORMAT_VERSION, "key": key, "spec": CachedSpec.of(spec), "ir": ir}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        blob = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, target)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        return


def _entry_path(key: str) -> Path:
    return cache_dir() / "capture" / f"{key}.pkl"


class _SafeUnpickler(pickle.Unpickler):
    """Loads only builtins, networkx and mlm classes: a torch object in an entry would import torch on a hit."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "mlm" or module.startswith(_ALLOWED_MODULES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"cache entry refers to {module}.{name}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _folder_hash(folder: Path) -> str:
    """Hash of the names and bytes of the .py files directly in `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.py")):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

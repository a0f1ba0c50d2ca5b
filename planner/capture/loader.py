"""Load MODEL (a model.py path or a preset name) and build it without allocating weights.

model.py convention (shared/DESIGN.md): a factory `build_model(**kwargs) -> nn.Module` (or `--entry NAME`, or a
module-level `model`), optional `example_inputs(batch_size, seq_len)` and `loss_fn(output, batch)`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mlm.planner.capture.presets.registry import PRESETS, Preset
from mlm.planner.errors import ModelLoadError

PRESET_PREFIX = "preset:"


@dataclass(frozen=True)
class ModelSpec:
    """A loaded model file: where it came from, its hash, the factory and the optional hooks."""

    source: str  # the path as given, or "preset:<name>"
    path: Path
    sha256: str
    entry: str
    args: dict[str, Any]
    module: ModuleType = field(repr=False, compare=False)
    preset: Preset | None = None

    @property
    def factory(self) -> Callable[..., Any]:
        return getattr(self.module, self.entry)

    @property
    def example_inputs(self) -> Callable[[int, int], Any] | None:
        return getattr(self.module, "example_inputs", None)

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor] | None:
        return getattr(self.module, "loss_fn", None)

    @property
    def display_name(self) -> str:
        return self.source[len(PRESET_PREFIX) :] if self.source.startswith(PRESET_PREFIX) else self.path.name


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """Parse repeated `key=value` strings; values are Python literals, else plain strings."""
    args: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ModelLoadError(f"--model-arg {item!r} is not of the form key=value")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        args[key.strip()] = value
    return args


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_model_spec(model: str, entry: str | None = None, args: dict[str, Any] | None = None) -> ModelSpec:
    """Resolve MODEL to a file, import it, and find its factory. Raises ModelLoadError with one clear line."""
    preset = None
    name = model[len(PRESET_PREFIX) :] if model.startswith(PRESET_PREFIX) else model
    if name in PRESETS and not Path(model).is_file():
        preset = PRESETS[name]
        path = Path(str(importlib.resources.files("mlm.planner.capture.presets").joinpath(preset.file)))
        source = PRESET_PREFIX + name
        merged = {**preset.args, **(args or {})}
    else:
        path = Path(model)
        if not path.suffix == ".py" and not path.exists():
            raise ModelLoadError(
                f"unknown model {model!r}: not a file, and not a preset (presets: {', '.join(PRESETS)})"
            )
        if not path.is_file():
            raise ModelLoadError(f"model file {model} does not exist")
        source = str(path.resolve())
        merged = dict(args or {})
    module = _import_file(path)
    entry_name = entry or _find_entry(module, path)
    if not hasattr(module, entry_name):
        raise ModelLoadError(f"{path.name} has no {entry_name!r} (--entry names the model factory)")
    return ModelSpec(
        source=source,
        path=path.resolve(),
        sha256=file_sha256(path),
        entry=entry_name,
        args=merged,
        module=module,
        preset=preset,
    )


def _import_file(path: Path) -> ModuleType:
    text = path.read_text()
    try:
        compile(text, str(path), "exec")
    except SyntaxError as e:
        raise ModelLoadError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    mod_name = "mlm_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
    try:
        with sibling_imports(path):
            spec.loader.exec_module(module)
    except Exception as e:  # user code: report where it failed
        del sys.modules[mod_name]
        raise ModelLoadError(f"importing {path} failed: {_user_frame(e, path)}") from None
    return module


@contextmanager
def sibling_imports(path: Path) -> Iterator[None]:
    """Let the model file import modules next to it (`from model import GPT`, as nanoGPT's scripts do): its
    directory leads sys.path while it runs, and the sibling modules it imported leave sys.modules afterwards, so
    two model directories that both hold a model.py do not see each other's (the functions keep their globals)."""
    folder = str(path.resolve().parent)
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
        added = set(sys.modules) - before
        siblings = {name for name in added if "." not in name and _beside(sys.modules[name], folder)}
        for name in added:
            if name.split(".")[0] in siblings:
                del sys.modules[name]


def _beside(module: ModuleType, folder: str) -> bool:
    """Whether a top-level module is a file or package directly inside `folder`."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    where = Path(file).resolve()
    return str(where.parent if where.name != "__init__.py" else where.parent.parent) == folder


def _find_entry(module: ModuleType, path: Path) -> str:
    for name in ("build_model", "model"):
        if hasattr(module, name):
            return name
    raise ModelLoadError(
        f"{path.name} defines no model factory: add build_model(**kwargs) returning an "
        f"nn.Module, a module-level `model`, or pass --entry NAME"
    )


def _user_frame(e: BaseException, path: Path) -> str:
    """'ExcType: message (file:line)' for the innermost frame inside the user's file."""
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            where = f" ({path.name}:{frame.lineno})"
    return f"{type(e).__name__}: {e}{where}"


def instantiate(spec: ModelSpec, device: str | torch.device = "meta") -> nn.Module:
    """Call the factory with spec.args under `device` (meta: no parameter memory) and check it is a module."""
    obj = spec.factory
    try:
        with torch.device(device), sibling_imports(spec.path):
            model = obj(**spec.args) if callable(obj) and not isinstance(obj, nn.Module) else obj
    except TypeError as e:
        if spec.args and "argument" in str(e):
            params = _signature_hint(obj)
            raise ModelLoadError(f"{spec.entry}() rejected the model arguments: {e}{params}") from None
        raise ModelLoadError(f"{spec.entry}() raised {_user_frame(e, spec.path)}") from None
    except Exception as e:  # user code
        raise ModelLoadError(f"{spec.entry}() raised {_user_frame(e, spec.path)}") from None
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{spec.entry}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def for_training(model: nn.Module, cpu: bool, experts: str = "eager") -> nn.Module:
    """Hugging Face models as their own Trainer runs them: no KV cache in training (transformers' cache update
    fails on tensor-parallel DTensors and keeps memory the plan does not price), and on the CPU the expert
    implementation `experts` instead of the default grouped_mm (torch's CPU grouped_mm takes bf16 only; the eager
    loop for real tensors, batched_mm for fake ones, whose shapes do not depend on the routing). Other models are
    untouched."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            continue
        if getattr(config, "use_cache", False):
            config.use_cache = False
        if cpu and getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = experts
    return model


def _signature_hint(obj: Any) -> str:
    try:
        return f" (signature: {spec_sig})" if (spec_sig := str(inspect.signature(obj))) else ""
    except (TypeError, ValueError):
        return ""

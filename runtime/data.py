"""Training batches that are the same under every layout: batch `step` depends only on (seed, step).

Every rank draws the whole global batch (token ids are small) and keeps its data-parallel rows, so a plan with
dp = 2 sees exactly the rows that dp = 1 sees, split in two. Sources: synthetic uniform tokens, or a flat binary
file of token ids (uint16 or uint32, as nanoGPT's prepare.py and Megatron's preprocessors write), sampled at
random offsets. Dropout masks are layout-independent the same way (DropoutSeeds, at the end).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from mlm.planner.capture.loader import ModelSpec
from mlm.planner.capture.training_step import Batch, example_batch
from mlm.planner.errors import PlanError
from mlm.planner.plan import Plan

DATA_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(PlanError):
    """The --data file cannot feed the plan."""


@dataclass(frozen=True)
class TokenSource:
    vocab: int
    seq_len: int
    global_batch: int
    seed: int
    path: Path | None = None
    dtype: str = "uint16"

    def check(self) -> None:
        """Fail early, with one line, on a data file that cannot give one batch."""
        if self.path is None:
            return
        if self.dtype not in DATA_DTYPES:
            raise DataError(f"--data-dtype {self.dtype!r}: expected one of {', '.join(DATA_DTYPES)}")
        if not self.path.is_file():
            raise DataError(f"data file {self.path} does not exist")
        n = self._tokens().shape[0]
        if n < self.seq_len + 1:
            raise DataError(
                f"data file {self.path} holds {n} tokens of {self.dtype}; one sample needs "
                f"seq_len + 1 = {self.seq_len + 1}"
            )

    def _tokens(self) -> np.ndarray:
        assert self.path is not None
        size = self.path.stat().st_size
        itemsize = np.dtype(DATA_DTYPES[self.dtype]).itemsize
        if size < itemsize:
            return np.zeros(0, dtype=DATA_DTYPES[self.dtype])
        return np.memmap(self.path, dtype=DATA_DTYPES[self.dtype], mode="r", shape=(size // itemsize,))

    def global_batch_at(self, step: int) -> torch.Tensor:
        """(global_batch, seq_len + 1) token ids for `step`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.path is None:
            return torch.randint(0, self.vocab, (self.global_batch, self.seq_len + 1), generator=gen)
        data = self._tokens()
        starts = torch.randint(0, data.shape[0] - self.seq_len, (self.global_batch,), generator=gen).tolist()
        rows = np.stack([np.asarray(data[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        tokens = torch.from_numpy(rows)
        top = int(tokens.max())
        if top >= self.vocab:
            raise DataError(
                f"data file {self.path} holds token id {top}, outside the model's vocabulary of "
                f"{self.vocab} (wrong --data-dtype?)"
            )
        return tokens

    def batch(self, step: int, dp_rank: int, dp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's (inputs, targets), each (global_batch / dp, seq_len)."""
        tokens = self.global_batch_at(step)
        rows = self.global_batch // dp
        mine = tokens[dp_rank * rows : (dp_rank + 1) * rows].to(device)
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()  # user code may .view() them (nanoGPT)


@dataclass(frozen=True)
class ExampleSource:
    """Batches from the model file's example_inputs(batch_size, seq_len), for models that are not fed one tensor of
    token ids (images, latents, encoder-decoder inputs): the whole global batch is drawn with torch's generator
    seeded from (seed, step), as TokenSource draws its ids, and each data-parallel rank keeps its rows of every
    tensor (dimension 0), so every layout sees the rows one device sees."""

    example_inputs: Callable[[int, int], Any]
    seq_len: int
    global_batch: int
    seed: int

    def check(self) -> None:
        """Fail early, with one line, when the example batch cannot be split by rows."""
        with torch.device("meta"):
            leaves = tree_leaves(example_batch(self.example_inputs, self.global_batch, self.seq_len))
        for t in leaves:
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != self.global_batch):
                raise DataError(
                    f"example_inputs({self.global_batch}, {self.seq_len}) returned a tensor of shape "
                    f"{tuple(t.shape)}: mlm-run splits the batch over micro-batches and data-parallel ranks by the "
                    f"first dimension, which must be the batch size"
                )

    def global_batch_at(self, step: int) -> Batch:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self.seed * 1_000_003 + step)
            return example_batch(self.example_inputs, self.global_batch, self.seq_len)

    def batch(self, step: int, dp_rank: int, dp: int, device: torch.device) -> Batch:
        """This data-parallel rank's (inputs, targets): global_batch / dp rows of every tensor."""
        rows = self.global_batch // dp
        return tree_map(  # a copy on the device: a view would keep the whole global batch alive (images are not small)
            lambda t: (
                t[dp_rank * rows : (dp_rank + 1) * rows].to(device, copy=True) if isinstance(t, torch.Tensor) else t
            ),
            self.global_batch_at(step),
        )


def data_source(plan: Plan, spec: ModelSpec, seed: int, path: Path | None, dtype: str) -> TokenSource | ExampleSource:
    """Where the run's batches come from: the --data file or random token ids for a model fed token ids, the
    model file's example_inputs when it defines one (then --data does not apply)."""
    if spec.example_inputs is None:
        return TokenSource(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch, seed, path, dtype)
    if path is not None:
        raise DataError(
            f"--data holds token ids, but {spec.path.name} defines example_inputs, which give this model its "
            f"batches (drop --data, or feed the data from example_inputs)"
        )
    return ExampleSource(spec.example_inputs, plan.training.seq_len, plan.training.global_batch, seed)


def split_rows(batch: Any, n: int) -> list[Any]:
    """`batch` (a tensor or a tuple / dict of them) cut into n micro-batches along dimension 0."""
    leaves, spec = tree_flatten(batch)
    chunks = [t.chunk(n) if isinstance(t, torch.Tensor) else [t] * n for t in leaves]
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(n)]


class DropoutSeeds:
    """Dropout masks that do not depend on the layout: before each plan layer runs on a micro-batch, the default
    generator of the CPU (and of the CUDA device) is seeded from (seed, step, global micro-batch index, layer FQN).

    The reference is one device running the same global batch as global_batch / micro_batch micro-batches of the
    plan's micro_batch rows, in order: data-parallel rank r's micro-batch j is global micro-batch r·n + j (n =
    num_microbatches), whose rows TokenSource.batch gives it. So a layer draws the same mask for the same rows
    under any dp and pp (every schedule runs a stage's forwards in micro-batch order; recompute restores the
    generator state checkpoint saved after the seeding). What differs: a plan with another micro_batch draws other
    masks (the same rows, another micro-batch). Under tp, dropout inside an attention / MLP region on an activation
    sharded over tp (heads, or the sequence-parallel residual) draws one device's whole mask on CPU and keeps its
    slice; on CUDA it draws from a generator seeded per tp rank, Megatron's way (runtime/tensor_parallel.py
    _RegionDropout); dropout on replicated activations is one device's mask on every tp rank."""

    def __init__(self, seed: int, dp_rank: int, num_microbatches: int, device: torch.device) -> None:
        self.seed, self.dp_rank, self.n, self.device = seed, dp_rank, num_microbatches, device
        self.step = 0
        self._calls: dict[int, int] = {}  # stage id -> forwards this step
        self._current = 0
        self.paused = False  # set while the pipeline infers shapes with an extra forward (train.py)

    def start_step(self, step: int) -> None:
        self.step = step
        self._calls.clear()

    def attach(self, stage: torch.nn.Module, layers: list[tuple[str, torch.nn.Module]]) -> None:
        def on_stage(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.paused:
                return
            j = self._calls.get(id(module), 0)
            self._calls[id(module)] = j + 1
            self._current = self.dp_rank * self.n + j % self.n

        stage.register_forward_pre_hook(on_stage, with_kwargs=True)
        for fqn, layer in layers:
            layer.register_forward_pre_hook(lambda _m, _a, fqn=fqn: self._seed(fqn))

    def _seed(self, fqn: str) -> None:
        key = f"{self.seed}/{self.step}/{self._current}/{fqn}".encode()
        value = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
        # the generators themselves: torch.manual_seed also queues a lazy CUDA seeding with a formatted stack
        # trace (~20 ms per call on CPU-only torch)
        torch.default_generator.manual_seed(value)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(value)

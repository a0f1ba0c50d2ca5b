"""Hugging Face decoders traced (capture) or run on fake tensors (the dry run) as they run in training.

transformers decides from the position ids whether several sequences are packed in a row
(masking_utils.find_packed_sequence_indices) and, when they may be, builds an explicit causal mask, for which its
SDPA path repeats grouped-query K/V to the query's heads. On a traced or fake tensor the test has no values to read,
so transformers assumes packing; in mlm-run the position ids are always 0..T-1 (one sequence per row), the test says
"not packed", and the model calls SDPA causal, without a mask, with its kv heads. Likewise under torch.export
transformers never skips the mask (an exported graph must not hard-code is_causal), which capture, pricing a
training step and not exporting a model, must not follow. `unpacked_positions` makes the traced and fake executions
take the branch the run takes. No transformers API exposes the choice, hence the wrapping (a no-op where
transformers is absent or lacks the functions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def unpacked_positions() -> Iterator[None]:
    """For the block's duration, transformers reads every position-id tensor as one sequence per row."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    replaced = {"find_packed_sequence_indices": _none, "is_torchdynamo_exporting": _false}
    saved = {name: getattr(masking_utils, name) for name in replaced if hasattr(masking_utils, name)}
    for name in saved:
        setattr(masking_utils, name, replaced[name])
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(masking_utils, name, original)


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _false(*args: Any, **kwargs: Any) -> bool:
    return False

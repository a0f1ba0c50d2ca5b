"""How a run ends when something goes wrong: preemption signals, non-finite steps, lost ranks.

- Preemption: SIGTERM (what SLURM and Kubernetes send) and SIGINT (Ctrl-C) only set a flag. The loop folds the
  flag into the step's one loss all-reduce, so every rank learns of a signal that reached any rank at the same
  step; they all finish that step, save, and exit 0. torchrun's agent forwards the signal it receives to the
  workers and kills them 30 s later, the grace period SLURM and Kubernetes also give.
- Non-finite loss or gradient norm: the loop stops with the step number (NonFiniteError, exit 2) before the
  optimizer step, so no NaN reaches the parameters or a checkpoint; or, with --skip-nonfinite, drops that step's
  update and counts it.
- A rank that dies: its peers' next collective fails (gloo sees the closed socket at once; otherwise the process
  group timeout, MLM_PG_TIMEOUT_S, turns a hang into an error); each says so in one line and exits 1, and the
  launcher names the rank that died first.

Test hook: MLM_INJECT_NONFINITE="STEP[:loss|grad][:RANK]" makes step STEP (1-based) produce a NaN loss or a NaN
gradient on RANK (default 0), so tests can exercise the non-finite path with a real model.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from mlm.planner.errors import PlanError

INJECT_ENV = "MLM_INJECT_NONFINITE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class NonFiniteError(PlanError):
    """A step produced a NaN or infinite loss or gradient norm (exit 2)."""


class PeerLostError(Exception):
    """A collective failed because another rank is gone."""


@dataclass
class StopRequest:
    """Set by a signal handler; read by the training loop at the end of each step."""

    signal_name: str | None = None
    previous: dict[int, Any] = field(default_factory=dict)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def install(self) -> StopRequest:
        """Catch SIGTERM and SIGINT (main thread only; elsewhere, e.g. in a test thread, do nothing)."""
        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:
                pass
        return self

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


@dataclass(frozen=True)
class Injection:
    step: int
    kind: str  # "loss" | "grad"
    rank: int


def injection_from_env() -> Injection | None:
    raw = os.environ.get(INJECT_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(":")
    try:
        step = int(parts[0])
        kind = parts[1] if len(parts) > 1 and parts[1] else "loss"
        rank = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise PlanError(f"{INJECT_ENV}={raw!r}: expected STEP[:loss|grad][:RANK]") from None
    if kind not in ("loss", "grad"):
        raise PlanError(f"{INJECT_ENV}={raw!r}: kind must be loss or grad")
    return Injection(step, kind, rank)


def is_peer_loss(error: BaseException) -> bool:
    """Whether a failed collective means another rank died (or timed out), rather than a bug here."""
    import torch.distributed as dist

    text = str(error)
    needles = (
        "Connection closed by peer",
        "Connection reset by peer",
        "Broken pipe",
        "Socket Timeout",
        "Timed out waiting",
        "timed out",
        "NCCL communicator was aborted",
        "ProcessGroupNCCL",
        "Connection refused",
        "recvBytes",
        "sendBytes",
        "Read error",
        "Write error",
    )
    return isinstance(error, dist.DistError) or any(n in text for n in needles)

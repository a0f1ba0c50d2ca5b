"""What every command shares: the error contract (exit 0 ok, 1 internal error, 2 bad input) and the consoles."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from rich.console import Console

from mlm.planner.errors import PlanError


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def run_command(body: Callable[[], int], debug: bool) -> int:
    """Run a command body; PlanError becomes one line and exit 2, anything else exit 1 (traceback with --debug)."""
    console = stderr_console()
    try:
        return body()
    except PlanError as e:
        if debug:
            traceback.print_exc()
        console.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in mlm: say so plainly
        if debug:
            traceback.print_exc()
        console.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {e} (rerun with --debug for the traceback)",
            soft_wrap=True,
        )
        return 1


def exit_with(code: int) -> None:
    sys.exit(code)

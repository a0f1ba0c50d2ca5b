"""mlm-whatif: capacity questions (time to train, GPUs for a deadline, what fits, sweeps)."""
from __future__ import annotations

import sys

from mlm.cli.common import stderr_console


def main(argv: list[str] | None = None) -> int:
    stderr_console().print("mlm-whatif is not implemented yet (issue 5)")
    return 2


if __name__ == "__main__":
    sys.exit(main())

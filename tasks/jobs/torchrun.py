"""``python -m tasks.jobs.torchrun ARGS`` is ``torchrun ARGS`` that cannot outlive the process that started it.

The local launcher starts torchrun in its own session, so that cancelling reaches every rank; the price
is that torchrun no longer dies with the flow process. When a worker SIGKILLs a flow run that has not
finished stopping its job within the worker's grace period, the kernel's parent-death signal
(Linux ``PR_SET_PDEATHSIG``) is what still stops torchrun, and, set again in each rank by
``tasks.pretrain.train``, the ranks when torchrun itself goes. Elsewhere than Linux it is plain torchrun.
"""

from __future__ import annotations

import os
import runpy
import sys

from tasks.processes import PARENT_PID_ENV, die_with_parent

__all__ = ["PARENT_PID_ENV", "die_with_parent", "main"]


def main() -> None:
    parent = os.environ.pop(PARENT_PID_ENV, None)
    die_with_parent(int(parent) if parent else None)
    sys.argv = ["torchrun", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""The GPU suite's process environment, set before any test initialises NCCL (it reads its variables once per
process)."""

from __future__ import annotations

import os

# sglang's Engine sets NCCL_CUMEM_ENABLE=0 in its schedulers unless it is set, and the ranks of one NCCL communicator
# must agree on it: `test_sglang_gpu` broadcasts from this process to sglang's ranks, after other tests have already
# initialised NCCL here. (The runner does the same for its workers: `rlinf_pipe.runner.components.nccl_env`.)
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

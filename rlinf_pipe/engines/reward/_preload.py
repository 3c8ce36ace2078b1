"""Imported once by the multiprocessing forkserver (see `RewardPool`): every reward worker forked from it starts
with math-verify, sympy and the LaTeX grammar loaded and warmed up."""

from rlinf_pipe.engines.reward import pool_worker as _pool_worker  # noqa: F401  (the workers' entry point)
from rlinf_pipe.engines.reward.verify import warm_up

warm_up()

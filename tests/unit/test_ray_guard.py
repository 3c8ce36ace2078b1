"""Ray's auto-init is off once our channel code is imported: a late call on a stale handle after `ray.shutdown()`
(a channel thread's, say) fails instead of starting a new Ray cluster in a process whose job is over."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import os, ray
import rlinf_pipe.scheduler.channel  # turns auto-init off
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
stale = ray.remote(lambda: 1)
assert ray.get(stale.remote()) == 1
ray.shutdown()
try:
    stale.remote()
except Exception as exc:
    print(type(exc).__name__, ray.is_initialized(), os.environ["RAY_ENABLE_AUTO_CONNECT"])
else:
    print("a new Ray was started:", ray.is_initialized())
"""


def test_a_call_after_shutdown_fails_instead_of_starting_ray():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "RaySystemError False 0"

"""Ray's auto-init is off once our channel code is imported: a late call on a stale handle after `ray.shutdown()`
(a channel thread's, say) fails instead of starting a new Ray cluster in a process whose job is over."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import os, ray
import rlinf_pipe.channels  # turns auto-init off
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


STOP_FIRST = """
import threading, ray
from rlinf_pipe.channels import Channel
from rlinf_pipe.channels.consumer import ConsumerEnd
from rlinf_pipe.errors import ChannelTimeout
seen = []
stop = ConsumerEnd.stop
ConsumerEnd.stop = lambda self: (seen.append(ray.is_initialized()), stop(self))[1]
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
channel = Channel.create("late", num_producers=1)
try:
    channel.get(timeout=0.2)  # a consuming end, whose thread keeps asking the registry for producers
except ChannelTimeout:
    pass
threads = [t for t in threading.enumerate() if t.name == "channel-late-consumer"]
ray.shutdown()
print(len(threads), threads[0].is_alive(), seen)
"""


def test_ray_shutdown_stops_the_channel_threads_before_it_disconnects():
    """A channel thread's call into Ray while `ray.shutdown()` tears the core worker down ends the whole process with
    exit status 1 (the suite's silent exits): `ray.shutdown` now stops the channel threads first."""
    out = subprocess.run([sys.executable, "-c", STOP_FIRST], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1 False [True]"

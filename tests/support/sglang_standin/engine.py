"""The stand-in `sglang.Engine`: the real one's public methods with its parameters (compared with the contract), a
tokenizer manager and a scheduler that behave like sglang 0.5.23's where an adapter trips (see their modules),
and a tiny HF model doing the work on CPU.

Like the real Engine it captures an event loop when it is built (the running one if there is one) and its
blocking methods drive that loop with `run_until_complete`: called from inside a running loop they fail with
"This event loop is already running" (or "Cannot run the event loop while another loop is running"). It has no
`tokenizer` attribute, and it refuses keyword arguments that are not server arguments. Like the real one it has
`shutdown` run at interpreter exit (`atexit`), so an engine nobody shut down leaves no scheduler task pending.

Like the real one it starts a scheduler process from the calling thread, which asks the kernel to SIGKILL it when
its parent dies (`prctl(PR_SET_PDEATHSIG)`, sglang's `kill_itself_when_parent_died`); on Linux that parent is the
THREAD that started it, so an Engine built in a thread that then ends loses its scheduler (sglang's watchdog then
SIGQUITs the engine's process; here every later call raises `SchedulerDied`). The stand-in's process does no work
but listen on the engine's torch.distributed store port, as sglang's TP rank 0 does (`nccl_port`, else a random free
one of 22000-29999 as sglang draws it): a port another process holds fails the start ("EADDRINUSE"). The scheduler
itself is a task on the tokenizer manager's loop (`scheduler.py`).

Like the real one it changes its host process (`host.py`): importing this module switches the asyncio policy,
building an Engine forces the start method and sets environment variables, and `shutdown` SIGKILLs every
descendant of the process that calls it (not only the engine's) and waits until they are gone.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

import psutil

from . import io_struct
from .contract import CONTRACT
from .host import configure_process, kill_descendants, switch_policy
from .scheduler import StandinScheduler
from .tokenizer_manager import StandinTokenizerManager

switch_policy("entrypoints/engine.py")


def _ensure_event_loop() -> asyncio.AbstractEventLoop:
    """sglang's `Engine._ensure_event_loop`: the running loop, else the policy's, else a new one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        try:
            return asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop


# The scheduler process: its death signal set (PR_SET_PDEATHSIG = 1, as sglang's `kill_itself_when_parent_died`),
# it listens on its torch.distributed store's port (TP rank 0's TCPStore, at `nccl_port`), says so and waits until
# it is killed (the engine's shutdown, or the signal) or its stdin closes. The store binds with SO_REUSEADDR, as torch's
# (libuv's bind sets it): connections left in TIME_WAIT by a killed engine do not keep it off its port.
_SCHEDULER_PROCESS = ("import ctypes, signal, socket, sys\n"
                      "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
                      "store = socket.socket()\n"
                      "store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                      "try:\n"
                      "    store.bind(('0.0.0.0', int(sys.argv[1]))); store.listen()\n"
                      "except OSError:\n"
                      "    sys.stdout.write('EADDRINUSE\\n'); sys.exit(1)\n"
                      "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
                      "sys.stdin.read()\n")


def _draw_port(low: int = 22000, high: int = 29999) -> int:
    """sglang's `get_free_port_below_ephemeral` when `nccl_port` is None: a random port of the range that binds now
    (the store binds it later, in the scheduler process)."""
    import random
    import socket

    for port in random.sample(range(low, high + 1), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port")


def _start_scheduler_process(nccl_port: int) -> subprocess.Popen:
    """Start the scheduler process from this thread and wait until its death signal is set and its store listens
    (sglang too waits for its scheduler to be ready before the Engine is built)."""
    child = subprocess.Popen([sys.executable, "-S", "-c", _SCHEDULER_PROCESS, str(nccl_port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    line = child.stdout.readline()
    if line == b"EADDRINUSE\n":  # (torch's TCPStore, in sglang's scheduler: the engine fails to start)
        child.wait()
        raise RuntimeError(f"The server socket has failed to listen on any local network address. port: {nccl_port}, "
                           "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    if line != b"ready\n":
        raise RuntimeError("the stand-in's scheduler process did not start")
    return child


SHUTDOWN_RECORD_ENV = "RLINF_PIPE_STANDIN_SHUTDOWNS"
"""A file each shut-down engine adds a JSON line to: its scheduler's pid and the processes its shutdown killed that
it did not start (those started while it was built are its own, as sglang's resource tracker, which its `spawn`
starts, is)."""


class Engine:
    """Stand-in for `sglang.Engine(**server_args)`; see the module docstring."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(CONTRACT["server_args"])
        if unknown:
            raise TypeError(f"Unexpected keyword arguments: {sorted(unknown)}")
        if "model_path" not in kwargs:
            raise TypeError("Missing required argument: 'model_path'")
        self.server_args = dict(kwargs)
        earlier = {p.pid for p in psutil.Process().children(recursive=True)}
        # (sglang 0.5.23's Engine configures logging in the building process: utils/common.py `configure_logger`)
        logging.basicConfig(level=getattr(logging, kwargs.get("log_level", "info").upper()),
                            format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True)
        if kwargs.get("enable_memory_saver") and "expandable_segments:true" in os.environ.get(
                "PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            # (torch_memory_saver, in the scheduler process that inherits this environment)
            raise RuntimeError("TorchMemorySaver is disabled for the current process because expandable_segments "
                               "is not supported yet.")
        configure_process()  # (sglang's `_set_envs_and_config`, before its schedulers start)
        self.scheduler = StandinScheduler(self.server_args)
        self.nccl_port = kwargs.get("nccl_port") or _draw_port()
        self.scheduler.process = _start_scheduler_process(self.nccl_port)
        self.scheduler.parent = threading.current_thread()
        self.tokenizer_manager = StandinTokenizerManager(self.scheduler, self.server_args)
        self.is_shut_down = False
        self.loop = _ensure_event_loop()
        atexit.register(self.shutdown)  # (sglang 0.5.23's Engine.__init__ does the same)
        self.started = {p.pid for p in psutil.Process().children(recursive=True)} - earlier  # (its processes)

    def _blocking(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    # --- generation -------------------------------------------------------------------------------------------
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                             video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                             custom_logit_processor=None, require_reasoning=False, return_hidden_states=False,
                             return_routed_experts=False, routed_experts_start_len=0, stream=False,
                             bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, routed_dp_rank=None,
                             disagg_prefill_dp_rank=None, kv_hints=None, data_parallel_rank=None,
                             external_trace_header=None, rid=None, session_params=None, priority=None,
                             session_id=None, *, cache_salt=None):
        if stream:
            raise NotImplementedError("the stand-in does not stream")
        obj = io_struct.GenerateReqInput(input_ids=input_ids, text=prompt, sampling_params=sampling_params,
                                         return_logprob=return_logprob, stream=stream, rid=rid)
        generator = self.tokenizer_manager.generate_request(obj, None)
        return await generator.__anext__()  # (as sglang's: the generator is left to be finalised when collected)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False, logprob_start_len=None,
                 top_logprobs_num=None, token_ids_logprob=None, lora_path=None, custom_logit_processor=None,
                 require_reasoning=False, return_hidden_states=False, return_routed_experts=False,
                 routed_experts_start_len=0, stream=False, bootstrap_host=None, bootstrap_port=None,
                 bootstrap_room=None, routed_dp_rank=None, disagg_prefill_dp_rank=None, kv_hints=None,
                 data_parallel_rank=None, external_trace_header=None, rid=None, session_params=None, priority=None,
                 session_id=None, *, cache_salt=None):
        return self._blocking(self.async_generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                                  return_logprob=return_logprob, stream=stream, rid=rid))

    def flush_cache(self):
        return self._blocking(self.tokenizer_manager.flush_cache())

    # --- weights ----------------------------------------------------------------------------------------------
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        return self._blocking(self.tokenizer_manager.init_weights_update_group(io_struct.InitWeightsUpdateGroupReqInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend), None))

    def destroy_weights_update_group(self, group_name):
        return self._blocking(self.tokenizer_manager.destroy_weights_update_group(
            io_struct.DestroyWeightsUpdateGroupReqInput(group_name=group_name), None))

    def begin_weight_update(self, selector="all"):
        return self._blocking(self.tokenizer_manager.begin_weight_update(
            io_struct.BeginWeightUpdateReqInput(selector=selector), None))

    def end_weight_update(self):
        return self._blocking(self.tokenizer_manager.end_weight_update(io_struct.EndWeightUpdateReqInput(), None))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        return self._blocking(self.tokenizer_manager.update_weights_from_distributed(
            io_struct.UpdateWeightsFromDistributedReqInput(names=names, dtypes=dtypes, shapes=shapes,
                                                           group_name=group_name, flush_cache=flush_cache,
                                                           load_format=load_format), None))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self._blocking(self.tokenizer_manager.update_weights_from_tensor(
            io_struct.UpdateWeightsFromTensorReqInput(serialized_named_tensors=named_tensors, load_format=load_format,
                                                      flush_cache=flush_cache), None))

    def get_weights_by_name(self, name, truncate_size=100):
        return self._blocking(self.tokenizer_manager.get_weights_by_name(
            io_struct.GetWeightsByNameReqInput(name=name, truncate_size=truncate_size), None))

    # --- memory / lifetime ------------------------------------------------------------------------------------
    def release_memory_occupation(self, tags=None):
        return self._blocking(self.tokenizer_manager.release_memory_occupation(
            io_struct.ReleaseMemoryOccupationReqInput(tags=tags), None))

    def resume_memory_occupation(self, tags=None):
        return self._blocking(self.tokenizer_manager.resume_memory_occupation(
            io_struct.ResumeMemoryOccupationReqInput(tags=tags), None))

    def shutdown(self):
        """As sglang's: SIGKILL every descendant of this process (the engine's scheduler process, and whatever else
        this process started) and wait until they are gone; then the scheduler task is cancelled, and run to its end
        when its loop is idle (a task left pending is reported as destroyed when the loop is collected)."""
        killed = kill_descendants()  # (on every call, as sglang's: its atexit hook kills again at exit)
        if self.is_shut_down:
            return
        self.is_shut_down = True
        process = self.scheduler.process
        if (record := os.environ.get(SHUTDOWN_RECORD_ENV)) and process is not None:
            with open(record, "a", encoding="utf-8") as out:  # (for the tests: which engines were shut down)
                others = [pid for pid in killed if pid not in self.started]
                out.write(json.dumps({"scheduler": process.pid, "killed_not_the_engines": others}) + "\n")
        task = self.scheduler.task
        if task is not None and not task.done():
            loop = task.get_loop()  # (the tokenizer manager's: running when shut down from a coroutine, or from
            if loop.is_running():   # another thread: a worker's control thread before it is killed)
                loop.call_soon_threadsafe(task.cancel)
            elif not loop.is_closed():
                task.cancel()
                loop.run_until_complete(asyncio.wait([task]))

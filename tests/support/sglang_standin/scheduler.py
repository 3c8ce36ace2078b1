"""The stand-in's scheduler and model runner (in sglang, a separate process per TP rank; here one asyncio task on
the tokenizer manager's loop and the TP ranks as threads where they must meet a process group).

What it models of sglang 0.5.23, because an adapter trips over it:
* continuous batching: every running request decodes one token per iteration; an aborted request (matched by rid
  prefix) finishes at the next iteration. A scheduler is idle only once an iteration ran with nothing to do after
  the last batch (`last_batch`), and it does not iterate without work: a release request arriving after the last
  result is handled at the start of the next iteration, before that batch is forgotten, and trips the idle
  assertion, while `flush_cache(timeout_s)` makes it iterate and answers once it is idle. It holds one such
  deferred flush at a time: a flush asked for while one is pending is answered at once, unflushed ("Another
  flush_cache is already in progress."), and the pending one still answers later (`SchedulerFlushWrapper`);
* seeds: `sampling_seed` draws per position only with deterministic inference; otherwise every request draws from
  the engine's one generator (seeded by `random_seed`) and a request seed is ignored, silently;
* weight updates only inside a weight-update session; a flattened-bucket payload is deserialized with the
  `SafeUnpickler` allow-list; `load_weights` skips names the model does not have, silently (Qwen2); an exception
  while loading from a tensor kills the scheduler, while the distributed path reports it;
* `init_weights_update_group` joins as sglang does (torch's `rendezvous`, a `PrefixStore` named after the group,
  `_new_process_group_helper`) at rank `rank_offset + tp_rank`; a flattened distributed update receives one
  broadcast of exactly the tensors' bytes per call;
* memory: releasing while not idle, resuming a tag not released, generating without a KV cache and loading into
  released weights kill the scheduler (as the real one dies, taking the engine with it); released weights are lost
  unless `enable_weights_cpu_backup`; without `enable_memory_saver` release and resume do nothing;
* `get_weights_by_name` answers only for model classes that implement it (None otherwise);
* its process (`engine.py`) dies with the thread that built the Engine, and so does the scheduler.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import pickle
import random
import threading
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from .contract import CONTRACT, message
from .groups import _join_as_sglang, _receive_broadcast

ALLOWED_GLOBALS = frozenset(tuple(name.rsplit(".", 1)) for name in CONTRACT["safe_unpickler_allowed"])
MEMORY_TAGS = tuple(CONTRACT["memory_tags"])


class SchedulerDied(RuntimeError):
    """The scheduler process is gone (sglang's child sends SIGQUIT to the engine's process; every call fails)."""


class _SafeUnpickler(pickle.Unpickler):
    """sglang's `SafeUnpickler`: only the globals of its allow-list (from the contract)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: dict[str, Any]
    done: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    past: Any = None
    finish: dict[str, Any] | None = None


class StandinScheduler:
    """One engine's scheduler (see the module docstring); `server_args` are the Engine's keyword arguments."""

    def __init__(self, server_args: dict[str, Any]):
        self.args = server_args
        dtype = server_args.get("dtype", "auto")
        self.model = AutoModelForCausalLM.from_pretrained(
            server_args["model_path"], dtype=torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
        ).eval()
        self.architecture = (self.model.config.architectures or ["?"])[0]
        self.eos_ids = self._eos_ids(server_args["model_path"])
        self.tp_size = int(server_args.get("tp_size", 1))
        seed = server_args.get("random_seed")
        self.seed = random.randint(0, 1 << 30) if seed is None else seed
        self.rng = torch.Generator().manual_seed(self.seed)
        self.deterministic = bool(server_args.get("enable_deterministic_inference"))
        self.running: dict[str, _Request] = {}
        self.last_batch: list[str] = []
        self.pending_flush: tuple[float, Callable[[bool, str], None]] | None = None  # (deadline, reply)
        self.controls: list[tuple[Any, asyncio.Future]] = []  # requests handled at the start of an iteration
        self.session: str | None = None
        self.released: set[str] = set()
        self.groups: dict[str, list[Any]] = {}
        self.died: str | None = None
        self.process: Any = None  # the scheduler process (`engine._start_scheduler_process`), and the thread that
        self.parent: threading.Thread | None = None  # started it: its parent as far as its death signal goes
        self.work: asyncio.Event | None = None  # created on the loop the scheduler runs on
        self.task: asyncio.Task | None = None
        self.iterations = 0

    def _eos_ids(self, path: str) -> set[int]:
        ids = [self.model.config.eos_token_id]
        try:
            ids.append(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError:
            pass
        return {e for x in ids for e in (x if isinstance(x, list) else [x]) if e is not None}

    # --- lifetime ---------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.work = asyncio.Event()
        self.task = loop.create_task(self._run())

    def check_alive(self) -> None:
        if self.died is None and self.process is not None and (self.process.poll() is not None or
                                                               not self.parent.is_alive()):
            self.die(f"its process was killed (exit code {self.process.poll()}): sglang's scheduler and detokenizer "
                     "processes ask to be killed when the thread that started them ends (PR_SET_PDEATHSIG), so the "
                     "thread that builds the Engine must outlive it")
        if self.died is not None:
            raise SchedulerDied(f"the SGLang scheduler died: {self.died}")

    def die(self, reason: str) -> None:
        self.died = reason
        for request in self.running.values():
            if not request.done.done():
                request.done.set_exception(SchedulerDied(f"the SGLang scheduler died: {reason}"))
        self.running.clear()
        self.check_alive()

    def is_fully_idle(self) -> bool:
        return not self.running and not self.last_batch

    def _wake(self) -> None:
        assert self.work is not None
        self.work.set()

    async def _run(self) -> None:
        assert self.work is not None
        while self.died is None:
            if not self.running and self.pending_flush is None and not self.controls:
                await self.work.wait()
            self.work.clear()
            self._iterate()
            await asyncio.sleep(0)

    async def control(self, call: Any) -> Any:
        """Run `call` at the start of the scheduler's next iteration (where sglang handles received requests)."""
        self.check_alive()
        reply = asyncio.get_running_loop().create_future()
        self.controls.append((call, reply))
        self._wake()
        return await reply

    def _iterate(self) -> None:
        self.iterations += 1
        self.check_alive()
        controls, self.controls = self.controls, []
        for call, reply in controls:
            try:
                result = call()  # (run whether or not its caller still waits, as sglang's scheduler does)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if not reply.done():
                    reply.set_exception(exc)
                if self.died is not None:
                    return
            else:
                if not reply.done():  # (sglang drops an answer nobody waits for)
                    reply.set_result(result)
        batch = list(self.running.values())
        if batch and "kv_cache" in self.released:
            self.die("an illegal memory access was encountered (a batch ran with the KV cache released)")
            return
        for request in batch:
            if request.finish is None:
                self._decode(request)
        for request in batch:
            if request.finish is not None:
                del self.running[request.rid]
                request.done.set_result(request)
        self.last_batch = [r.rid for r in batch]
        if self.pending_flush is not None:
            deadline, reply = self.pending_flush
            if self.is_fully_idle() or asyncio.get_running_loop().time() >= deadline:
                self.pending_flush = None
                idle = self.is_fully_idle()
                reply(idle, "" if idle else "Timed out waiting for idle state.")

    # --- generation -------------------------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list[int], params: dict[str, Any]) -> asyncio.Future:
        self.check_alive()
        done = asyncio.get_running_loop().create_future()
        self.running[rid] = _Request(rid, prompt, params, done)
        self._wake()
        return done

    def abort(self, rid: str, abort_all: bool) -> None:
        for request in self.running.values():
            if (abort_all or request.rid.startswith(rid)) and request.finish is None:
                request.finish = {"type": "abort", "message": "Abort before prefill" if not request.tokens
                                  else "Aborted", "status_code": None, "err_type": None}

    def _generator(self, request: _Request) -> torch.Generator:
        seed = request.params.get("sampling_seed")
        if not self.deterministic:
            return self.rng
        position = len(request.prompt) + len(request.tokens)
        digest = hashlib.blake2b(f"{42 if seed is None else seed}/{position}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)

    @torch.no_grad()
    def _decode(self, request: _Request) -> None:
        sp = request.params
        feed = torch.tensor([request.prompt if request.past is None else request.tokens[-1:]])
        out = self.model(input_ids=feed, past_key_values=request.past, use_cache=True)
        request.past = out.past_key_values
        greedy = sp["temperature"] < 1e-6
        logp = torch.log_softmax(out.logits[0, -1].float() / (1.0 if greedy else sp["temperature"]), dim=-1)
        probs = logp.exp()
        top_k = 1 if greedy else sp["top_k"]
        if top_k != -1:
            kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if sp["top_p"] < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.zeros_like(probs, dtype=torch.bool)
            keep[order] = (torch.cumsum(sorted_p, 0) - sorted_p) < sp["top_p"] * sorted_p.sum()
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=self._generator(request)))
        request.tokens.append(token)
        request.logprobs.append(float(logp[token]))
        # (as sglang 0.5.23's `_check_token_based_finish`: under ignore_eos no stop id counts either)
        stop = set() if sp["ignore_eos"] else set(sp["stop_token_ids"] or []) | self.eos_ids
        if token in stop:
            request.finish = {"type": "stop", "matched": token}
        elif len(request.tokens) >= sp["max_new_tokens"]:
            request.finish = {"type": "length", "length": sp["max_new_tokens"]}

    def flush(self, timeout_s: float | None, reply: Callable[[bool, str], None]) -> None:
        """A flush request, handled at the start of an iteration: `reply(flushed, message)` at once (idle, no
        timeout, or another flush pending), or once idle within `timeout_s` (deferred: one at a time)."""
        if self.pending_flush is not None:
            reply(False, "Another flush_cache is already in progress.")
        elif self.is_fully_idle() or not timeout_s:
            reply(self.is_fully_idle(), "")
        else:
            self.pending_flush = (asyncio.get_running_loop().time() + timeout_s, reply)

    # --- weights ----------------------------------------------------------------------------------------------
    def begin_weight_update(self, selector: str) -> tuple[bool, str]:
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"selector must be target, draft or all, got {selector!r}")
        if self.session is not None:
            return False, message("session_already_open")
        self.session = selector
        return True, "Succeeded to begin the weight update."

    def end_weight_update(self) -> tuple[bool, str]:
        if self.session is None:
            return False, message("no_session_open")
        self.session = None
        return True, "Succeeded to end the weight update."

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Like `Qwen2ForCausalLM.load_weights`: names the model lacks are skipped, a wrong shape raises."""
        if "weights" in self.released:
            self.die("an illegal memory access was encountered (weights loaded while released)")
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named:
                if name in state:
                    if state[name].shape != tensor.shape:
                        raise AssertionError(f"Attempted to load weight ({tensor.shape}) into parameter "
                                             f"({state[name].shape})")
                    state[name].copy_(tensor)

    def update_from_tensor(self, payloads: list[bytes], load_format: str | None) -> tuple[bool, str]:
        if self.session is None:
            return False, message("tensor_update_outside_session")
        if len(payloads) < self.tp_size:
            self.die(f"IndexError: list index out of range (tp_rank {len(payloads)} has no payload)")
        if load_format != "flattened_bucket":
            raise NotImplementedError(f"the stand-in models load_format='flattened_bucket' only, got {load_format!r}")
        try:
            buckets = [_SafeUnpickler(io.BytesIO(payloads[rank])).load() for rank in range(self.tp_size)]
            self.load_weights(_reconstruct(buckets[0]["flattened_tensor"], buckets[0]["metadata"]))
        except SchedulerDied:
            raise
        except Exception as exc:  # noqa: BLE001 - in sglang an exception here ends the scheduler process
            self.die(f"{type(exc).__name__}: {exc}")
        return True, "Success"

    def join_group(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str) -> tuple[bool, str]:
        """Every TP rank joins (blocking until every member has): rank 0 as sglang does, the others (threads of this
        process, which torch lets register a group name only once) with the same store prefixes."""
        members: list[Any] = [None] * self.tp_size
        errors: list[BaseException] = []

        def join(tp_rank: int) -> None:
            try:
                members[tp_rank] = _join_as_sglang(address, port, rank_offset + tp_rank, world_size, group_name,
                                                   backend, registered=tp_rank == 0)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(r,)) for r in range(self.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            return False, f"Failed to initialize custom process group: {errors[0]}."
        self.groups[group_name] = members
        return True, "Succeeded to initialize custom process group."

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                                load_format: str | None) -> tuple[bool, str]:
        if self.session is None:
            return False, message("distributed_update_outside_session")
        if group_name not in self.groups:
            raise AssertionError(f"Group {group_name} not in {list(self.groups)}. Please call "
                                 "`init_weights_update_group` first.")
        if load_format != "flattened_bucket":
            raise NotImplementedError(f"the stand-in models load_format='flattened_bucket' only, got {load_format!r}")
        metadata, offset = [], 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            torch_dtype = getattr(torch, dtype)
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=torch_dtype).element_size()
            if offset % torch.empty(0, dtype=torch_dtype).element_size():
                raise ValueError(f"Unaligned received tensor {name}")
            metadata.append(_Meta(name, torch.Size(shape), torch_dtype, offset, offset + nbytes, nbytes))
            offset += nbytes
        received: list[torch.Tensor] = [torch.empty(offset, dtype=torch.uint8) for _ in range(self.tp_size)]
        threads = [threading.Thread(target=_receive_broadcast, args=(self.groups[group_name][r], received[r], r == 0))
                   for r in range(self.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            self.load_weights(_reconstruct(received[0], metadata))
        except SchedulerDied:
            raise
        except Exception as exc:  # noqa: BLE001 - the distributed path reports it
            return False, f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are " \
                          "partially updated. Please discard the whole weights."
        return True, "Succeeded to update parameter online from distributed."

    def weights_by_name(self, name: str, truncate_size: int) -> Any:
        if self.architecture not in CONTRACT["models_with_get_weights_by_name"]:
            return None  # "TODO: Add support for Qwen models": an error is logged, None returned
        tensor = self.model.state_dict().get(name)
        return None if tensor is None else tensor.float().tolist()[:truncate_size]

    # --- memory -----------------------------------------------------------------------------------------------
    def _tags(self, tags: list[str] | None) -> list[str]:
        return list(MEMORY_TAGS) if not tags else list(tags)

    def release(self, tags: list[str] | None) -> None:
        if not self.is_fully_idle():
            self.die(f"AssertionError: {message('release_not_idle')}")
        if not self.args.get("enable_memory_saver"):
            return
        for tag in self._tags(tags):
            self.released.add(tag)
            if tag == "weights" and not self.args.get("enable_weights_cpu_backup"):
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.fill_(float("nan"))  # released without a backup: the memory holds nothing useful

    def resume(self, tags: list[str] | None) -> None:
        if not self.args.get("enable_memory_saver"):
            return
        for tag in self._tags(tags):
            if tag not in self.released:
                self.die(f"KeyError: {tag!r}")
            self.released.remove(tag)


@dataclass(frozen=True)
class _Meta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _reconstruct(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]

"""A CPU stand-in for `sglang.Engine` (sglang 0.5.23), for testing `SGLangEngine` without a GPU.

Its public members have the real Engine's names and signatures (`tests/unit/test_sglang_engine.py` checks them
against a recorded copy), it validates arguments the way the real one would, and it generates real tokens with
real log-probs from a tiny HF model. Everything else is our own: one KV-cached forward per token per request,
interleaved on the event loop so short requests finish first. Every call is recorded in `calls`.

Behaviour modelled on sglang 0.5.23 (facts, not code): output dicts `{"output_ids", "meta_info"}` with
`meta_info["output_token_logprobs"]` as (logprob, token_id, None) tuples (no text: skip_tokenizer_init) and
`meta_info["finish_reason"]` a dict whose `type` is stop / length / abort; temperature 0 means greedy with
log-probs at temperature 1; log-probs are log(softmax(logits / T)) before top-k / top-p; the stop token is in
`output_ids`; weight calls return `(success, message)`; `sampling_seed` is refused unless
`sampling_backend="pytorch"`; memory calls need `enable_memory_saver=True`.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

# ServerArgs fields this stand-in understands (a real Engine has many more; it rejects unknown ones)
KNOWN_SERVER_ARGS = frozenset({
    "model_path", "tp_size", "mem_fraction_static", "dtype", "random_seed", "skip_tokenizer_init",
    "enable_memory_saver", "enable_weights_cpu_backup", "sampling_backend", "log_level", "load_format",
    "trust_remote_code", "base_gpu_id", "disable_cuda_graph", "enable_deterministic_inference",
    "max_running_requests",
})
# the API fields of sglang's SamplingParams (sglang/srt/sampling/sampling_params.py)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
})
SUPPORTED_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "n", "ignore_eos", "sampling_seed",
})
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class StandinTokenizerManager:
    """The one TokenizerManager member the adapter uses: `abort_request`."""

    def __init__(self, engine: SGLangEngineStandin):
        self._engine = engine

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self._engine.calls.append(("abort_request", {"rid": rid, "abort_all": abort_all}))
        if not abort_all and not rid:
            return
        for running in list(self._engine.running):
            if abort_all or running == rid:
                self._engine.aborted.add(running)


class SGLangEngineStandin:
    """Stand-in for `sglang.Engine(**server_args)`; see the module docstring."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - KNOWN_SERVER_ARGS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing required argument: 'model_path'")
        self.server_args = dict(kwargs)
        self.calls: list[tuple[str, dict[str, Any]]] = [("__init__", dict(kwargs))]
        path = kwargs["model_path"]
        dtype = kwargs.get("dtype", "auto")
        torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        eos = {self.model.config.eos_token_id}
        try:
            eos.add(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError:
            pass
        self.eos_ids = {e for x in eos for e in (x if isinstance(x, list) else [x]) if e is not None}
        self.released: set[str] = set()
        self.groups: set[str] = set()
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self._seeds = random.Random(kwargs.get("random_seed") or 0)
        self.tokenizer_manager = StandinTokenizerManager(self)
        self.is_shut_down = False

    def _record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def calls_of(self, name: str) -> list[dict[str, Any]]:
        return [kw for n, kw in self.calls if n == name]

    # --- generation -------------------------------------------------------------------------------------

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        mm_hashes=None,
        mm_content_hashes=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        require_reasoning=False,
        return_hidden_states=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        kv_hints=None,
        data_parallel_rank=None,
        external_trace_header=None,
        rid=None,
        session_params=None,
        priority=None,
        session_id=None,
        *,
        cache_salt=None,
    ):
        self._record("async_generate", input_ids=input_ids, sampling_params=sampling_params,
                     return_logprob=return_logprob, stream=stream, rid=rid)
        if stream:
            raise NotImplementedError("the stand-in does not stream")
        if prompt is not None:
            raise NotImplementedError("the stand-in takes input_ids only (skip_tokenizer_init)")
        if (prompt is None) == (input_ids is None):
            raise ValueError("Either text or input_ids should be provided.")
        if self.released:
            raise RuntimeError(f"generate while memory is released ({sorted(self.released)})")
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
                raise TypeError(f"input_ids must be list[int] or list[list[int]], got {input_ids!r}")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(prompts)
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if batch and rid is not None and not isinstance(rid, list):
            raise ValueError("The rid should be a list for batch processing.")
        if len(params) != len(prompts) or len(rids) != len(prompts):
            raise ValueError("sampling_params / rid must have one entry per prompt")
        outs = await asyncio.gather(*[
            self._one(p, sp, r if r is not None else f"standin-{self._seeds.getrandbits(32):08x}", return_logprob)
            for p, sp, r in zip(prompts, params, rids, strict=True)
        ])
        return outs if batch else outs[0]

    def _check_sampling(self, sp: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(sp, dict):
            raise TypeError(f"sampling_params must be a dict, got {type(sp)}")
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got unexpected keyword arguments {sorted(unknown)}")
        unsupported = {k for k in set(sp) - SUPPORTED_SAMPLING_KEYS if sp[k] not in (None, False, 0, 0.0, 1.0)}
        if unsupported:
            raise NotImplementedError(f"the stand-in does not model sampling keys {sorted(unsupported)}")
        out = {"max_new_tokens": 128, "stop_token_ids": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
               "n": 1, "ignore_eos": False, "sampling_seed": None}
        out.update({k: v for k, v in sp.items() if k in SUPPORTED_SAMPLING_KEYS})
        if out["n"] != 1:
            raise NotImplementedError("the stand-in models n == 1 only")
        if out["top_k"] != -1 and out["top_k"] < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {out['top_k']}.")
        if not 0.0 < out["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {out['top_p']}.")
        if out["temperature"] < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {out['temperature']}.")
        seed = out["sampling_seed"]
        if seed is not None:
            if not isinstance(seed, int) or not -(2**63) <= seed <= 2**63 - 1:
                raise ValueError(f"sampling_seed must be an integer in [-2**63, 2**63 - 1], got {seed!r}.")
            if self.server_args.get("sampling_backend") != "pytorch":
                raise AssertionError("Sampling seed is not supported for flashinfer backend")
        if out["temperature"] < 1e-6:  # greedy, as sglang does it
            out["temperature"], out["top_k"] = 1.0, 1
        return out

    async def _one(self, prompt: list[int], raw: dict[str, Any], rid: str, return_logprob: bool) -> dict[str, Any]:
        sp = self._check_sampling(raw)
        if rid in self.running:
            raise ValueError(f"Duplicate request ID: {rid}")
        gen = torch.Generator().manual_seed(
            (sp["sampling_seed"] if sp["sampling_seed"] is not None else self._seeds.getrandbits(63)) % 2**63
        )
        stop = set(sp["stop_token_ids"] or []) | (set() if sp["ignore_eos"] else self.eos_ids)
        self.running.add(rid)
        tokens: list[int] = []
        logprobs: list[float] = []
        past = None
        feed = torch.tensor([prompt])
        reason: dict[str, Any] | None = None
        try:
            while reason is None:
                await asyncio.sleep(0)  # let other requests step
                if rid in self.aborted:
                    reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                with torch.no_grad():
                    out = self.model(input_ids=feed, past_key_values=past, use_cache=True)
                past = out.past_key_values
                scaled = out.logits[0, -1].float() / sp["temperature"]
                logp = torch.log_softmax(scaled, dim=-1)
                probs = logp.exp()
                if sp["top_k"] != -1:
                    kth = torch.topk(probs, min(sp["top_k"], probs.numel())).values[-1]
                    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                if sp["top_p"] < 1.0:
                    sorted_p, order = torch.sort(probs, descending=True)
                    before = torch.cumsum(sorted_p, 0) - sorted_p
                    keep = torch.zeros_like(probs, dtype=torch.bool)
                    keep[order] = before < sp["top_p"] * sorted_p.sum()
                    probs = torch.where(keep, probs, torch.zeros_like(probs))
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                feed = torch.tensor([[token]])
                if token in stop:
                    reason = {"type": "stop", "matched": token}
                elif len(tokens) >= sp["max_new_tokens"]:
                    reason = {"type": "length", "length": sp["max_new_tokens"]}
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": reason, "prompt_tokens": len(prompt), "weight_version": "default",
            "completion_tokens": len(tokens), "cached_tokens": 0,
        }
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, tokens, strict=True)]
            meta["output_token_logprobs_length"] = len(tokens)
        return {"output_ids": tokens, "meta_info": meta}

    # --- weights ----------------------------------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address,
        master_port,
        rank_offset,
        world_size,
        group_name,
        backend="nccl",
    ):
        self._record("init_weights_update_group", master_address=master_address, master_port=master_port,
                     rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)
        if not isinstance(master_port, int) or not isinstance(rank_offset, int) or world_size < 2:
            return False, "invalid process group arguments"
        self.groups.add(group_name)
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(
        self,
        group_name,
    ):
        self._record("destroy_weights_update_group", group_name=group_name)
        if group_name not in self.groups:
            return False, f"group {group_name!r} does not exist"
        self.groups.discard(group_name)
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name="weight_update_group",
        flush_cache=True,
        load_format=None,
    ):
        self._record("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                     group_name=group_name, flush_cache=flush_cache, load_format=load_format)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        if not all(isinstance(d, str) and isinstance(getattr(torch, d, None), torch.dtype) for d in dtypes):
            raise ValueError(f"dtypes must be torch dtype names, got {dtypes!r}")
        if group_name not in self.groups:
            return False, f"Failed to update weights: group {group_name!r} is not initialized"
        self._check_weights_resident()
        return True, "Succeeded to update parameter online from distributed."

    def update_weights_from_tensor(
        self,
        named_tensors,
        load_format=None,
        flush_cache=True,
    ):
        self._record("update_weights_from_tensor", names=[n for n, _ in named_tensors],
                     load_format=load_format, flush_cache=flush_cache)
        if load_format is not None:
            raise NotImplementedError(f"the stand-in models load_format=None only, got {load_format!r}")
        if not isinstance(named_tensors, list) or not all(
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
            for x in named_tensors
        ):
            raise TypeError("named_tensors must be a list of (str, torch.Tensor) tuples")
        self._check_weights_resident()
        state = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in state:
                return False, f"Failed to update weights: unknown parameter {name}"
            if tuple(state[name].shape) != tuple(tensor.shape):
                return False, f"Failed to update weights: shape mismatch for {name}"
        with torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)
        return True, "Success"

    def _check_weights_resident(self) -> None:
        if "weights" in self.released:
            raise RuntimeError("weights are released: resume_memory_occupation(['weights']) before loading them")

    def flush_cache(self):
        self._record("flush_cache")
        return True

    # --- memory / lifetime ------------------------------------------------------------------------------

    def _tags(self, tags) -> list[str]:
        if not self.server_args.get("enable_memory_saver"):
            raise RuntimeError("memory occupation calls need enable_memory_saver=True")
        tags = list(MEMORY_TAGS) if tags is None else tags
        if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
            raise ValueError(f"tags must be a list of {MEMORY_TAGS}, got {tags!r}")
        return tags

    def release_memory_occupation(self, tags=None):
        self._record("release_memory_occupation", tags=tags)
        chosen = self._tags(tags)
        if self.running:
            raise RuntimeError("release_memory_occupation with requests running")
        if set(chosen) & self.released:
            raise RuntimeError(f"already released: {sorted(set(chosen) & self.released)}")
        self.released.update(chosen)

    def resume_memory_occupation(self, tags=None):
        self._record("resume_memory_occupation", tags=tags)
        chosen = self._tags(tags)
        if set(chosen) - self.released:
            raise RuntimeError(f"not released: {sorted(set(chosen) - self.released)}")
        self.released.difference_update(chosen)

    def shutdown(self):
        self._record("shutdown")
        self.is_shut_down = True

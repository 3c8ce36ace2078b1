"""One sglang request of `SGLangEngine`: its result read from the tokenizer manager's generator, which is run to
its end here (`generate_one`), an abort that waits until sglang's scheduler holds the request (`Aborts`), and the
result as a sample (`to_sample`)."""

from __future__ import annotations

import asyncio
from typing import Any

from rlinf_pipe.engines.rollout.engine import SampleOutput
from rlinf_pipe.engines.rollout.sglang_errors import NAN_SAMPLED, SGLangError, finish_reason_of

REQUEST_DISPATCHED = "dispatched"
"""The field of sglang 0.5.23's per-request state (`ReqState`) that says the request reached the scheduler."""
ABORT_RETRY_S = 0.005
"""How often an abort waiting for its request to reach the scheduler looks again (sglang says nothing when it is
sent; it is sent as soon as it is tokenised and the model-update lock is free)."""


async def generate_one(tm: Any, request: Any) -> dict[str, Any]:
    """One request's result (`request`: an `io_struct.GenerateReqInput`, not streaming). The tokenizer manager's
    generator holds sglang's model-update lock as a reader from before the request is sent until it goes past its
    `yield`: one left suspended there, as `Engine.async_generate` leaves it for the garbage collector to finalise,
    holds back every weight update for as long as anything refers to it. So it is run to its end, or closed, here."""
    results = tm.generate_request(request, None)
    out: dict[str, Any] | None = None
    try:
        async for out in results:  # (one result)
            pass
    finally:
        await results.aclose()
    if out is None:
        raise SGLangError(f"sglang returned no result for request {request.rid!r}")
    return out


class Aborts:
    """Aborts of sglang requests, each sent once the scheduler holds its request. sglang sends one abort per request,
    and its scheduler drops one for a request it does not hold yet (registered, but still being tokenised or
    waiting for the model-update lock), which then runs to `max_new_tokens`. `inflight`: the rids still running
    (an abort waits no longer than its request). Use on the loop generating (sglang's socket is not thread-safe)."""

    def __init__(self, tm: Any, inflight: set[str]):
        self.tm, self.inflight = tm, inflight
        self.waiting: dict[str, asyncio.Task] = {}  # rid -> the task that aborts it once it was dispatched

    def abort(self, rid: str) -> None:
        """Abort `rid` now if sglang's scheduler holds it, else as soon as it does."""
        state = self.tm.rid_to_state.get(rid)
        if state is None or getattr(state, REQUEST_DISPATCHED, True):
            self.tm.abort_request(rid=rid)
        elif rid not in self.waiting:
            self.waiting[rid] = asyncio.ensure_future(self._once_dispatched(rid))

    async def _once_dispatched(self, rid: str) -> None:
        try:
            while rid in self.inflight:
                state = self.tm.rid_to_state.get(rid)
                if state is None:  # (it ended before it reached the scheduler)
                    return
                if getattr(state, REQUEST_DISPATCHED, True):
                    self.tm.abort_request(rid=rid)
                    return
                await asyncio.sleep(ABORT_RETRY_S)
        finally:
            self.waiting.pop(rid, None)


def to_sample(out: dict[str, Any], version: int) -> SampleOutput:
    """One sglang result as a sample: its tokens, their log-probs (from `output_token_logprobs`), the reason."""
    meta = out["meta_info"]
    reason = finish_reason_of(meta)
    if isinstance(meta.get("finish_reason"), dict) and meta["finish_reason"].get("matched") == NAN_SAMPLED:
        # (sglang put an EOS id in place of the token in output_ids; its log-prob is the invalid id's)
        raise SGLangError(f"sglang request {meta.get('id')!r} sampled a token outside the vocabulary after "
                          f"{len(out.get('output_ids', [])) - 1} tokens: the logits held NaN or inf (the weights "
                          "may have diverged: check the last steps' grad_norm and loss, or resume from an "
                          "earlier checkpoint); the torch engine fails the same way")
    output_ids = [int(t) for t in out.get("output_ids", [])]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise SGLangError(f"sglang returned no output_token_logprobs for request {meta.get('id')!r}")
    logprobs = [float(lp) for lp, _, _ in triples]
    lp_ids = [int(t) for _, t, _ in triples]
    if lp_ids != output_ids and not (reason == "stop" and output_ids == lp_ids[:-1]):
        # (a version that trims the stop token from output_ids still lists it with its log-prob: kept)
        raise SGLangError(f"sglang request {meta.get('id')!r}: output_ids ({len(output_ids)}) and the token ids "
                          f"of output_token_logprobs ({len(lp_ids)}) disagree")
    return SampleOutput(response_ids=lp_ids, logprobs=logprobs, finish_reason=reason, version=version)

"""What sglang 0.5.23 answers when something goes wrong, as rlinf_pipe's errors: refused calls, the finish reasons
of its results, the requests it aborts itself."""

from __future__ import annotations

from typing import Any

from rlinf_pipe.engines.rollout.engine import FinishReason


def aborted_message(exc: Exception) -> str:
    """What a request sglang aborted itself means (sglang 0.5.23 raises a ValueError for status 400, a fastapi
    `HTTPException` with `status_code` and `detail` for the others), with the keys that change it."""
    status = getattr(exc, "status_code", 400)
    detail = getattr(exc, "detail", None) or str(exc)
    if "out of memory" in str(detail).lower():
        hint = ("the engine's KV cache cannot hold the sequences it decodes at once: lower "
                "rollout.max_running_requests or rollout.max_new_tokens, or raise rollout.gpu_memory_fraction "
                "(`rlinf-pipe plan` shows the estimate)")
    elif status == 400:
        hint = ("sglang refused the request: check data.max_prompt_length + rollout.max_new_tokens against the "
                "model's context, and the sampling settings (rollout.*)")
    else:
        hint = "see the rollout worker's output for sglang's own log"
    return f"sglang aborted a request (status {status}): {detail}; {hint}"


class SGLangError(RuntimeError):
    """sglang refused a call (its message is included)."""


# the start of sglang 0.5.23's answer to `begin_weight_update` while a session is open
# (managers/scheduler_components/weight_updater.py)
SESSION_OPEN = "a weight-update session is already open"
# sglang 0.5.23's finish reason when a sampled id fell outside the vocabulary (NaN or inf probabilities:
# schedule_batch.py `_check_vocab_boundary_finish`), reported as a stop
NAN_SAMPLED = "NaN happened"


def finish_reason_of(meta_info: dict[str, Any]) -> FinishReason:
    """A result's finish reason (`meta_info`'s, a dict or a string in sglang) as ours."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise SGLangError(f"sglang returned an unexpected finish_reason {reason!r} for request {meta_info.get('id')!r}")

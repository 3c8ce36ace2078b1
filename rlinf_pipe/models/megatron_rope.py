"""Megatron's unfused rotary embedding, with each forward's cosines and sines computed once and packed sequences
in one gather.

megatron-core (without Transformer Engine's fused kernels) applies the rotary embedding to the queries and the keys
of every layer with `rope_utils._apply_rotary_pos_emb_bshd`, which computes `cos(freqs)` and `sin(freqs)` at every
call, and for packed (`thd`) sequences with `_apply_rotary_pos_emb_thd`, which first splits the stream into its
sequences (a host sync for their lengths), slices each one's frequencies and concatenates them: a fifth of a
packed forward of the tiny model on a CPU. `install()` replaces both (once; `apply_rotary_pos_emb` looks them up at
each call):

- `bshd`: the same arithmetic on cosines and sines computed once per frequency table (Megatron's rotary module
  returns the same table object for a sequence length; the packed one below is one object per stream);
- `thd`: each token's position in its row (`packed_rows.positions_of`: those a packed stream carries, else from the
  boundaries), one gather of the table, then the `bshd` path.

The values are Megatron's bit for bit (tests/unit/test_megatron_rope.py). Under context parallelism a rank's
share of a stream carries its tokens' positions (`models/context_parallel.py`), and takes the same gather. What is
not covered (multi-latent attention, context parallelism on a stream without positions, a frequency table as long
as the stream, which Megatron maps by offsets) goes to the originals.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.models.context_parallel import SHARE_ATTR
from rlinf_pipe.models.packed_rows import positions_of

BSHD_PARAMETERS = ("t", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale")
THD_PARAMETERS = ("t", "cu_seqlens", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale", "cp_group")
CACHED = 8  # tables whose cosines and sines are kept (a few sequence lengths and packed streams at a time)

_lock = threading.Lock()
_originals: dict[str, Any] = {}
# id(table) -> (table, mscale, dtype, cos, sin); the table is held so that its id is not reused meanwhile
_cos_sin: OrderedDict[int, tuple[Tensor, float, torch.dtype, Tensor, Tensor]] = OrderedDict()
_packed: tuple[Tensor, Tensor, Tensor] | None = None  # (cu_seqlens, table, the stream's table) of the last stream


def _cached_cos_sin(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    with _lock:
        entry = _cos_sin.get(id(freqs))
        if entry is not None and entry[0] is freqs and entry[1] == mscale and entry[2] == dtype:
            _cos_sin.move_to_end(id(freqs))
            return entry[3], entry[4]
    with torch.inference_mode(False), torch.no_grad():  # constants, usable in any later autograd graph
        cos, sin = (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)
    with _lock:
        _cos_sin[id(freqs)] = (freqs, mscale, dtype, cos, sin)
        while len(_cos_sin) > CACHED:
            _cos_sin.popitem(last=False)
    return cos, sin


def _apply_bshd(t: Tensor, freqs: Tensor, rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                mscale: float = 1.0) -> Tensor:
    """`rope_utils._apply_rotary_pos_emb_bshd` (t `[s, ..., dim]`, freqs `[s, ..., rot_dim]`) on cached cos / sin."""
    from megatron.core.models.common.embeddings import rope_utils

    if multi_latent_attention or freqs.requires_grad:
        return _originals["bshd"](t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = _cached_cos_sin(freqs, mscale, t.dtype)
    t = (t * cos) + (rope_utils._rotate_half(t, rotary_interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1) if t_pass.numel() else t  # (Megatron copies t into a cat of itself)


def _packed_table(cu_seqlens: Tensor, freqs: Tensor, total: int) -> Tensor:
    """The frequency table of each token of the stream (one object per stream, so its cos / sin are cached)."""
    global _packed
    with _lock:
        if _packed is not None and _packed[0] is cu_seqlens and _packed[1] is freqs:
            return _packed[2]
    table = freqs[positions_of(cu_seqlens, total)]
    with _lock:
        _packed = (cu_seqlens, freqs, table)
    return table


def _apply_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
               multi_latent_attention: bool = False, mscale: float = 1.0, cp_group: Any = None) -> Tensor:
    """`rope_utils._apply_rotary_pos_emb_thd` (t `[T, heads, dim]`, freqs `[max_len, 1, 1, dim]`), vectorised."""
    total = t.shape[0]
    if cp_group is not None and cp_group.size() > 1:  # ours only on a rank's share that carries its positions
        original = not getattr(cu_seqlens, SHARE_ATTR, False)  # (models/context_parallel.py)
    else:
        original = freqs.size(0) == total  # (Megatron maps a table as long as the stream by offsets)
    if original or multi_latent_attention:
        return _originals["thd"](t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    table = _packed_table(cu_seqlens, freqs, total)
    return _apply_bshd(t.unsqueeze(1), table, rotary_interleaved=rotary_interleaved, mscale=mscale).squeeze(1)


def install() -> None:
    """Replace Megatron's two unfused rotary functions (once). Raises `RuntimeError` naming the installed
    megatron-core if their parameters changed."""
    from megatron.core.models.common.embeddings import rope_utils

    with _lock:
        if _originals:
            return
        targets = {"bshd": ("_apply_rotary_pos_emb_bshd", BSHD_PARAMETERS, _apply_bshd),
                   "thd": ("_apply_rotary_pos_emb_thd", THD_PARAMETERS, _apply_thd)}
        for attr, expected, _ in targets.values():
            names = tuple(inspect.signature(getattr(rope_utils, attr)).parameters)
            if names != expected:
                from megatron.core import package_info

                raise RuntimeError(f"megatron-core {package_info.__version__} changed rope_utils.{attr} (parameters "
                                   f"{names}, expected {expected}); update rlinf_pipe/models/megatron_rope.py")
        for kind, (attr, _, replacement) in targets.items():
            _originals[kind] = getattr(rope_utils, attr)
            setattr(rope_utils, attr, replacement)

"""token_logprobs / token_entropy against plain torch log_softmax, full vocabulary and a simulated TP=2 split."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rlinf_pipe.engines.policy.logprobs import (
    CHUNK_BYTES,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from rlinf_pipe.utils.net import free_port

VOCAB, PADDED, B, L, TEMP = 11, 12, 3, 7, 0.7


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, PADDED, generator=g, dtype=torch.float64).float() * 3
    logits[..., VOCAB:] = 50.0  # padded columns: huge, must not count
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    return logits, ids


def _reference(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits[:, :-1, :VOCAB].double() / TEMP, dim=-1)
    lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros(B, 1, dtype=torch.float64)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def _weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)


@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, 4 * PADDED * (L - 1) * 2, 4 * PADDED * 2],
                         ids=["one-chunk", "two-sequences-a-chunk", "two-positions-a-chunk"])
def test_matches_log_softmax_values_and_gradients(chunk_bytes: int):
    logits, ids = _data()
    ref_lp, ref_ent = _reference(logits, ids)
    w_lp, w_ent = _weights()

    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(x, ids, TEMP, VOCAB, chunk_bytes=chunk_bytes)
    assert lp.shape == ent.shape == (B, L) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    y = logits.double().clone().requires_grad_(True)
    r_lp, r_ent = _reference(y, ids)
    ((r_lp * w_lp.double()).sum() + (r_ent * w_ent.double()).sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)
    assert torch.all(x.grad[..., VOCAB:] == 0) and torch.isfinite(x.grad).all()

    torch.testing.assert_close(token_logprobs(logits, ids, TEMP, VOCAB), lp.detach())
    torch.testing.assert_close(token_entropy(logits, TEMP, VOCAB), ent.detach())


def test_a_loss_of_log_probs_only_matches_and_low_precision_logits_stay_low_precision():
    logits, ids = _data()
    x = logits.clone().requires_grad_(True)
    (token_logprobs(x, ids, TEMP, VOCAB) * _weights()[0]).sum().backward()
    y = logits.double().clone().requires_grad_(True)
    (_reference(y, ids)[0] * _weights()[0].double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)
    for chunk_bytes in (4 * PADDED * 3, CHUNK_BYTES):  # chunked, and through log_softmax at once
        half = logits.bfloat16().requires_grad_(True)
        lp = token_logprobs(half, ids, TEMP, VOCAB, chunk_bytes=chunk_bytes)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), _reference(logits.bfloat16().double(), ids)[0], atol=1e-4, rtol=1e-4)
        lp.sum().backward()
        assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad.float()).all()
        assert torch.all(half.grad[..., VOCAB:] == 0)


def test_bad_inputs():
    logits, ids = _data()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, 0.0, VOCAB)
    with pytest.raises(ValueError, match="input_ids"):
        token_logprobs(logits, ids[:, :-1], 1.0, VOCAB)
    with pytest.raises(ValueError, match="vocab"):
        token_logprobs(logits, ids, 1.0, PADDED + 1)


def _tp_worker(rank: int, port: int, out_dir: str, vocab: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, ids = _data()
        shard = logits[..., rank * (PADDED // 2) : (rank + 1) * (PADDED // 2)].clone().requires_grad_(True)
        group = torch.distributed.group.WORLD
        ids = ids.remainder(vocab)
        lp, ent = token_logprobs_and_entropy(shard, ids, TEMP, vocab, tp_group=group)
        lp_only = token_logprobs(shard.detach(), ids, TEMP, vocab, tp_group=group)
        ent_only = token_entropy(shard.detach(), TEMP, vocab, tp_group=group)
        w_lp, w_ent = _weights()
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        torch.save(
            {"lp": lp.detach(), "ent": ent.detach(), "grad": shard.grad, "lp_only": lp_only, "ent_only": ent_only},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("vocab", [VOCAB, PADDED // 2 - 1], ids=["padding-on-rank-1", "rank-1-all-padding"])
def test_tensor_parallel_split_matches_full(tmp_path, vocab):
    mp.spawn(_tp_worker, args=(free_port(), str(tmp_path), vocab), nprocs=2, join=True)
    logits, ids = _data()
    ids = ids.remainder(vocab)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(x, ids, TEMP, vocab)
    w_lp, w_ent = _weights()
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    half = PADDED // 2
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(r["lp"], lp.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["ent"], ent.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["lp_only"], lp.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["ent_only"], ent.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["grad"], x.grad[..., rank * half : (rank + 1) * half], atol=1e-5, rtol=1e-4)

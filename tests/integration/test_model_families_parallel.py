"""Qwen3 and Llama 3 trained by `MegatronPolicy` split by tensor parallelism (gloo, 2 processes) equal the single
process: the same log-probs, loss, gradient norm and updated weights (Qwen3's per-head q/k norms hold the same values
on both TP ranks and get the gradient of every head: Megatron sums theirs over the TP group)."""

from __future__ import annotations

import pytest
import torch
from support.actor_run import LOSS, make_batch, select_rows, spawn, vocab_size, with_old_logprobs

from rlinf_pipe.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow

SPLIT = [[0, 1], [2], [3, 4, 5]]


def _one_step(rank: int, model_path: str, sequence_parallel: bool = False, pack_sequences: bool = True) -> dict:
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_path, lr=1e-3, adam_eps=1e-4, sequence_parallel=sequence_parallel,
                            pack_sequences=pack_sequences)
    batch = make_batch(2, 6, vocab_size(model_path))
    logprobs = policy.compute_logprobs(batch)
    batch = with_old_logprobs(batch, logprobs)
    for rows in SPLIT:
        policy.train_micro_batch(select_rows(batch, rows), LOSS)
    metrics = policy.optimizer_step()
    norms = {n: p.detach().clone() for n, p in policy.module.named_parameters() if "layernorm" in n}
    return {"logprobs": logprobs, "metrics": metrics, "hf": dict(policy.hf_weights()), "norms": norms}


@pytest.mark.parametrize("arch, sequence_parallel, packed", [
    ("qwen3", False, True), ("llama3", False, True), ("qwen3", True, True), ("llama3", True, False)])
def test_tensor_parallel_training_equals_one_process(tmp_path, arch, sequence_parallel, packed):
    """TP 2, with sequence parallelism too (its norms' gradients summed over the TP group), on packed streams and on
    padded rows (both made a multiple of TP long)."""
    model = str(ensure_tiny_model(tmp_path / "models", arch=arch, tie_word_embeddings=arch == "llama3"))
    (single,) = spawn(1, _one_step, str(tmp_path / "one"), model_path=model, pack_sequences=packed)
    tp2 = spawn(2, _one_step, str(tmp_path / "tp2"), parallel={"tp": 2}, model_path=model,
                sequence_parallel=sequence_parallel, pack_sequences=packed)
    for rank in tp2:
        torch.testing.assert_close(rank["logprobs"], single["logprobs"], atol=1e-5, rtol=1e-5)
        assert rank["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], abs=1e-6)
        assert rank["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-4)
    for name, norm in tp2[0]["norms"].items():  # (replicated weights stay equal on every TP rank)
        assert torch.equal(norm, tp2[1]["norms"][name]), name
    streamed = tp2[0]["hf"]
    assert streamed.keys() == single["hf"].keys()
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in streamed
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, single["hf"][name], atol=2e-6, rtol=1e-5, msg=name)



def test_context_parallel_training_equals_one_process(tmp_path):
    """CP 2, and TP 2 x CP 2 with sequence parallelism: each rank runs its load-balanced share of every packed
    sequence, attention gathers the keys and values over the CP group; the log-probs gathered back, the loss of the
    whole micro-batch, the gradients (summed over the CP ranks) and the updated weights equal one process's."""
    model = str(ensure_tiny_model(tmp_path / "models", arch="qwen3"))
    (single,) = spawn(1, _one_step, str(tmp_path / "one"), model_path=model)
    for parallel, sequence_parallel in (({"cp": 2}, False), ({"tp": 2, "cp": 2}, True)):
        world = parallel.get("tp", 1) * parallel["cp"]
        ranks = spawn(world, _one_step, str(tmp_path / f"world{world}"), parallel=parallel, model_path=model,
                      sequence_parallel=sequence_parallel)
        for rank in ranks:
            torch.testing.assert_close(rank["logprobs"], single["logprobs"], atol=1e-5, rtol=1e-5)
            assert rank["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], abs=1e-6)
            assert rank["metrics"]["tokens"] == single["metrics"]["tokens"]
            assert rank["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-4)
        for name, tensor in ranks[0]["hf"].items():
            torch.testing.assert_close(tensor, single["hf"][name], atol=2e-6, rtol=1e-5, msg=f"{parallel} {name}")


def _pipeline_step(rank: int, model_path: str) -> dict:
    """`_one_step` on a pipeline: the log-probs exist on the last stage, whose last rank sends them to every rank
    to train on (the world's last rank is on the last stage whatever the other sizes)."""
    import torch.distributed as dist

    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_path, lr=1e-3, adam_eps=1e-4)
    batch = make_batch(2, 6, vocab_size(model_path))
    own = policy.compute_logprobs(batch)  # (None on the first stage)
    box = [own]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    batch = with_old_logprobs(batch, box[0])
    for rows in SPLIT:
        policy.train_micro_batch(select_rows(batch, rows), LOSS)
    metrics = policy.optimizer_step()
    return {"own": own, "metrics": metrics, "hf": dict(policy.hf_weights())}


def test_pipeline_and_context_parallel_training_equals_one_process(tmp_path):
    """PP 2 x CP 2: each stage's CP ranks hold their shares of every packed sequence and pass the stage's
    activations on to the next stage's CP rank of the same share; the last stage's log-probs, the loss, the
    gradient norm and the updated weights (gathered from both stages) equal one process's."""
    model = str(ensure_tiny_model(tmp_path / "models", arch="qwen3"))
    (single,) = spawn(1, _one_step, str(tmp_path / "one"), model_path=model)
    ranks = spawn(4, _pipeline_step, str(tmp_path / "pp2cp2"), parallel={"pp": 2, "cp": 2}, model_path=model)
    assert [rank["own"] is None for rank in ranks] == [True, True, False, False]  # (stage 1: ranks 2 and 3)
    for rank in ranks:
        if rank["own"] is not None:
            torch.testing.assert_close(rank["own"], single["logprobs"], atol=1e-5, rtol=1e-5)
        assert rank["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], abs=1e-6)
        assert rank["metrics"]["tokens"] == single["metrics"]["tokens"]
        assert rank["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-4)
    assert ranks[0]["hf"].keys() == single["hf"].keys()
    for name, tensor in ranks[0]["hf"].items():
        torch.testing.assert_close(tensor, single["hf"][name], atol=2e-6, rtol=1e-5, msg=name)


def _resumed_step(rank: int, model_path: str, ckpt: str) -> dict:
    """A step, a checkpoint, a second step; then a fresh policy loads the checkpoint and takes the second step."""
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    vocab = vocab_size(model_path)
    first, second = make_batch(1, 6, vocab), make_batch(2, 6, vocab)
    out = {}
    for name in ("straight", "resumed"):
        policy = MegatronPolicy(model_path, lr=1e-3, adam_eps=1e-4)
        if name == "straight":
            batch = with_old_logprobs(first, policy.compute_logprobs(first))
            policy.train_micro_batch(batch, LOSS)
            policy.optimizer_step()
            policy.save_checkpoint(ckpt)
        else:
            policy.load_checkpoint(ckpt)
        batch = with_old_logprobs(second, policy.compute_logprobs(second))
        policy.train_micro_batch(batch, LOSS)
        out[name] = (policy.optimizer_step(), {n: p.detach().clone() for n, p in policy.module.named_parameters()})
    return out


def test_a_context_parallel_checkpoint_resumes_exactly(tmp_path):
    """CP 2: the model shard and the optimizer state are written once (the CP ranks hold equal copies) and a fresh
    policy that loads them takes the next step exactly as the one that saved them."""
    model = str(ensure_tiny_model(tmp_path / "models", arch="qwen3"))
    ranks = spawn(2, _resumed_step, str(tmp_path / "cp2"), parallel={"cp": 2}, model_path=model,
                  ckpt=str(tmp_path / "ckpt"))
    for rank in ranks:
        (metrics, params), (resumed_metrics, resumed) = rank["straight"], rank["resumed"]
        assert metrics == resumed_metrics
        for name, tensor in params.items():
            assert torch.equal(tensor, resumed[name]), name
    assert sorted(p.name for p in (tmp_path / "ckpt" / "trainer").iterdir() if p.name.startswith("optim")) == [
        "optim_tp00_pp000_dp000.pt"]

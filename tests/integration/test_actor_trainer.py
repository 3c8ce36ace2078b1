"""MegatronPolicy on CPU (gloo): HF-exact log-probs, streaming-exact gradients, packed == padded micro-batches,
DP=2 == DP=1, offload round trip, checkpoint resume. Each scenario runs in freshly spawned processes (see tests/support/actor_run.py)."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch
from support.actor_run import (
    LOSS,
    capture_grads,
    make_batch,
    make_grouped_batch,
    params_of,
    select_rows,
    spawn,
    vocab_size,
    with_old_logprobs,
)

from rlinf_pipe.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow

LR = 1e-3
# Adam's epsilon of these runs. Compared runs sum the same gradients in other orders, so they agree to ~1e-7; with
# the default 1e-8 a near-zero gradient whose sign flips moves its parameter by up to 2 x LR, which no parameter
# comparison survives. With 1e-4 an update differs by at most LR x 1e-7 / 1e-4 = 1e-6 (the comparisons allow 2e-6).
ADAM_EPS = 1e-4
DP1_SPLIT = [[0, 1], [2], [3, 4, 5]]
DP2_SPLIT = {0: [[0, 1], [2]], 1: [[3, 4, 5]]}  # uneven: 2 micro-batches on rank 0, 1 on rank 1
RESUME_SPLIT = {0: [[5], [0, 2]], 1: [[1, 3, 4]]}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models")))


def _policy(model_path: str, **kw):
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    return MegatronPolicy(model_path, lr=LR, adam_eps=ADAM_EPS, **kw)


def _train(policy, batch, splits) -> dict[str, float]:
    for rows in splits:
        policy.train_micro_batch(select_rows(batch, rows), LOSS)
    return policy.optimizer_step()


def _hf_reference(model_path: str, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.double()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    lp = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros(lp.shape[0], 1, dtype=lp.dtype)
    valid = batch.attention_mask
    return torch.cat([zero, lp], 1).masked_fill(~valid, 0), torch.cat([zero, ent], 1).masked_fill(~valid, 0)


def _single_process(rank: int, model_path: str) -> dict:
    from safetensors.torch import load_file

    vocab = vocab_size(model_path)
    out: dict = {}
    # 1. log-probs and entropy equal the HF model's (several forward micro-batches, the last one padded)
    a = _policy(model_path, logprob_max_tokens=40)
    batch = make_batch(0, 7, vocab)
    for temp in (1.0, 0.7):
        lp, ent = a.compute_logprobs(batch, temperature=temp, with_entropy=True)
        ref_lp, ref_ent = _hf_reference(model_path, batch, temp)
        out[f"lp_err_{temp}"] = float((lp.double() - ref_lp).abs().max())
        out[f"ent_err_{temp}"] = float((ent.double() - ref_ent).abs().max())
        out[f"packed_{temp}"] = (lp, ent)
    # alone (no pipeline stages), each forward micro-batch keeps its own shape: no filler; the log-probs are those of
    # micro-batches padded to one shape, as a pipeline-parallel schedule needs them
    from rlinf_pipe.engines.policy.model_inputs import logprob_micro_batches

    shapes = {}
    for same in (True, False):
        for packed in (True, False):
            _, inputs = logprob_micro_batches(batch, 40, packed, torch.device("cpu"), same_shape=same)
            shapes[(same, packed)] = [m.shape for m in inputs]
    out["chunk_shapes"] = shapes
    out["chunk_real_tokens"] = [int(batch.attention_mask[r.start:r.stop].sum()) for r in
                                logprob_micro_batches(batch, 40, True, torch.device("cpu"))[0]]
    a_same = _policy(model_path, logprob_max_tokens=40)
    a_same.pp_size = 2  # (only the shape rule reads it here: the schedule of a single stage runs either way)
    out["same_shape_0.7"] = a_same.compute_logprobs(batch, temperature=0.7, with_entropy=True)
    # the HF weight stream reproduces the HF checkpoint
    hf_state = load_file(f"{model_path}/model.safetensors")
    streamed = dict(a.hf_weights())
    out["bucket_names_ok"] = set(streamed) == {n for n in hf_state if n != "lm_head.weight"} | (
        set(streamed) & {"lm_head.weight"})
    out["bucket_max_err"] = max(float((streamed[n] - hf_state[n]).abs().max()) for n in streamed)

    # 2. the same batch in one micro-batch vs shuffled micro-batches of different sizes
    fixed = make_batch(1, 6, vocab)
    fixed = with_old_logprobs(fixed, a.compute_logprobs(fixed))
    grads_a = capture_grads(a)
    m_a1 = _train(a, fixed, [[0, 1, 2, 3, 4, 5]])
    out["grads_whole"] = dict(grads_a)
    out["params_whole"] = params_of(a)
    m_a2 = _train(a, fixed, [[0, 1, 2, 3, 4, 5]])  # 3. loss on the fixed batch after one step
    out["loss_before"], out["loss_after"] = m_a1["loss"], m_a2["loss"]
    out["metrics_whole"] = m_a1

    stream_split = [[4, 1], [0], [5, 3, 2]]
    b = _policy(model_path)
    grads_b = capture_grads(b)
    out["metrics_streamed"] = _train(b, fixed, stream_split)
    out["grads_streamed"] = dict(grads_b)
    out["params_streamed"] = params_of(b)

    # padded micro-batches (pack_sequences=False): the packed ones' log-probs, entropies and gradients
    padded = _policy(model_path, logprob_max_tokens=40, pack_sequences=False)
    out["packing"] = (a.pack_sequences, padded.pack_sequences)
    out["padded_0.7"] = padded.compute_logprobs(batch, temperature=0.7, with_entropy=True)
    grads_padded = capture_grads(padded)
    out["metrics_padded"] = _train(padded, fixed, stream_split)
    out["grads_padded"] = dict(grads_padded)

    # rows of one prompt share it (the default): the same log-probs, entropies and gradients as unshared packing,
    # and as HF's model; log-probs in chunks of 40 tokens (some groups split between chunks)
    grouped = make_grouped_batch(3, 3, 4, vocab)
    shared, unshared = _policy(model_path, logprob_max_tokens=40), _policy(model_path, logprob_max_tokens=40,
                                                                           share_prompts=False)
    out["sharing"] = (shared.share_prompts, unshared.share_prompts)
    out["grouped_hf"] = _hf_reference(model_path, grouped, 0.7)
    out["grouped_logprobs"] = [p.compute_logprobs(grouped, temperature=0.7, with_entropy=True)
                               for p in (shared, unshared)]
    grouped = with_old_logprobs(grouped, out["grouped_logprobs"][0][0])
    out["grouped_grads"], out["grouped_metrics"] = [], []
    for p in (shared, unshared):
        grads = capture_grads(p)
        out["grouped_metrics"].append(_train(p, grouped, [[0, 3, 6, 9, 1, 4], [2, 5, 8, 11, 7, 10]]))
        out["grouped_grads"].append(dict(grads))

    # 4. offload / onload round trip: training continues bit for bit
    c = _policy(model_path)
    _train(c, fixed, stream_split)
    out["offload_bytes"] = b.offload(force=True)
    out["freed"] = all(p.untyped_storage().nbytes() == 0 for p in b.module.parameters())
    out["onload_bytes"] = b.onload()
    out["state_bytes"] = b.state_nbytes()
    out["cpu_noop_bytes"] = (b.offload(), b.onload())
    _train(b, fixed, stream_split)
    _train(c, fixed, stream_split)
    out["offload_equal"] = all(torch.equal(x, y) for x, y in zip(params_of(b).values(), params_of(c).values(), strict=True))

    inference = _policy(model_path, train=False)  # no DDP, no optimizer: weights only
    before = inference.compute_logprobs(fixed)
    out["inference_offload"] = (inference.offload(force=True), inference.onload())
    out["inference_equal"] = torch.equal(before, inference.compute_logprobs(fixed))

    # 5. the DP=1 reference of the DP=2 run
    d = _policy(model_path)
    glob = make_batch(2, 6, vocab)
    out["dp1_logprobs"] = d.compute_logprobs(glob)
    glob = with_old_logprobs(glob, out["dp1_logprobs"])
    out["dp1_init"] = params_of(d)
    out["dp1_metrics"] = _train(d, glob, DP1_SPLIT)
    out["dp1_params"] = params_of(d)
    out["dp1_hf"] = dict(d.hf_weights())
    # 6. clear errors: a micro-batch without response tokens; a step with nothing accumulated; a step whose
    # caller sent more micro-batches than the rank trained (one still queued behind it)
    empty = msgspec.structs.replace(glob, response_mask=torch.zeros_like(glob.response_mask))
    out["errors"] = []
    for call in (lambda: d.train_micro_batch(empty, LOSS), d.optimizer_step,
                 lambda: (d.train_micro_batch(glob, LOSS), d.optimizer_step(expected_micro_batches=2))):
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            out["errors"].append(str(exc))
    return out


def _model_parallel(rank: int, model_path: str, sequence_parallel: bool = False) -> dict:
    """TP=2 (with or without sequence parallelism) or PP=2 (one replica): the DP=1 run's log-probs and update,
    compared in HF names."""
    vocab = vocab_size(model_path)
    p = _policy(model_path, sequence_parallel=sequence_parallel)
    glob = make_batch(2, 6, vocab)
    logprobs = p.compute_logprobs(glob)
    box = [logprobs]
    torch.distributed.broadcast_object_list(box, src=1 if p.pp_size > 1 else 0)
    glob = with_old_logprobs(glob, box[0])
    out = {"logprobs": logprobs, "metrics": _train(p, glob, DP1_SPLIT)}
    out["hf"] = dict(p.hf_weights())
    grouped = make_grouped_batch(3, 3, 4, vocab)  # shared prompts, in log-prob chunks of one stream length
    out["grouped"] = _policy(model_path, train=False, logprob_max_tokens=40).compute_logprobs(
        grouped, temperature=0.7, with_entropy=True)
    return out


def _dp2_then_save(rank: int, model_path: str, ckpt: str) -> dict:
    vocab = vocab_size(model_path)
    p = _policy(model_path)
    assert p.use_distributed_optimizer and p.dp_size == 2
    glob = make_batch(2, 6, vocab)
    glob = with_old_logprobs(glob, p.compute_logprobs(glob))
    metrics = _train(p, glob, DP2_SPLIT[rank])
    out = {"metrics": metrics, "params1": params_of(p)}
    p.save_checkpoint(ckpt)
    out["rng"] = torch.rand(4)
    nxt = make_batch(3, 6, vocab)
    nxt = with_old_logprobs(nxt, p.compute_logprobs(nxt))
    out["metrics2"] = _train(p, nxt, RESUME_SPLIT[rank])
    out["params2"] = params_of(p)
    return out


def _save_with_a_slow_rank_zero(rank: int, model_path: str, ckpt: str) -> dict:
    """The world's collectives time out after 1 s (as NCCL's minutes would for a large checkpoint on NFS); rank 0
    writes its model shard for 3 s."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    from rlinf_pipe.models import megatron_checkpoint

    p = _policy(model_path)
    _set_pg_timeout(timedelta(seconds=1))
    save = megatron_checkpoint.save_model_shard

    def slow_save(*args, **kwargs):
        if rank == 0:
            time.sleep(3)  # (a slow file system, not a synchronisation)
        return save(*args, **kwargs)

    megatron_checkpoint.save_model_shard = slow_save
    return {"saved": str(p.save_checkpoint(ckpt))}


def _save_and_load_failing_on_rank_one(rank: int, model_path: str, ckpt: str) -> dict:
    """Rank 1 cannot write its file (a full disk), then cannot find it when loading: what each rank raises."""
    from rlinf_pipe.engines.policy import checkpoint

    p = _policy(model_path)
    out: dict = {}
    save = checkpoint.torch.save

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith("rng_rank00001.pt"):
            raise OSError(28, "No space left on device")
        return save(obj, path, *args, **kwargs)

    checkpoint.torch.save = full_disk
    try:
        p.save_checkpoint(ckpt)
    except checkpoint.CheckpointError as exc:
        out["save_error"] = str(exc)
    checkpoint.torch.save = save
    checkpoint.file_barrier()  # (rank 0 removed the half-written folder before it raised)
    out["left_after_failed_save"] = sorted(os.listdir(os.path.dirname(ckpt)))
    checkpoint.file_barrier()  # (before rank 0 prepares the next save)
    p.save_checkpoint(ckpt)
    if rank == 1:
        os.remove(os.path.join(ckpt, "trainer", "rng_rank00001.pt"))
    checkpoint.file_barrier()  # (the file is gone before either rank loads)
    try:
        p.load_checkpoint(ckpt)
    except checkpoint.CheckpointError as exc:
        out["load_error"] = str(exc)
    return out


def _dp2_resume(rank: int, model_path: str, ckpt: str) -> dict:
    vocab = vocab_size(model_path)
    p = _policy(model_path)
    p.load_checkpoint(ckpt)
    out = {"rng": torch.rand(4), "step": p.step}
    nxt = make_batch(3, 6, vocab)
    nxt = with_old_logprobs(nxt, p.compute_logprobs(nxt))
    out["metrics2"] = _train(p, nxt, RESUME_SPLIT[rank])
    out["params2"] = params_of(p)
    return out


@pytest.fixture(scope="module")
def single(model_path, tmp_path_factory) -> dict:
    (result,) = spawn(1, _single_process, str(tmp_path_factory.mktemp("single")), model_path=model_path)
    return result


@pytest.fixture(scope="module")
def dp2(model_path, tmp_path_factory) -> tuple[list[dict], list[dict], str]:
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "step1")
    first = spawn(2, _dp2_then_save, str(tmp_path_factory.mktemp("dp2a")), model_path=model_path, ckpt=ckpt)
    resumed = spawn(2, _dp2_resume, str(tmp_path_factory.mktemp("dp2b")), model_path=model_path, ckpt=ckpt)
    return first, resumed, ckpt


def _assert_params_close(a: dict, b: dict, atol: float = 2e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-5, msg=name)


def test_logprobs_match_hf(single):
    for temp in (1.0, 0.7):
        assert single[f"lp_err_{temp}"] < 1e-4
        assert single[f"ent_err_{temp}"] < 1e-4


def test_hf_weight_stream_reproduces_hf_checkpoint(single):
    assert single["bucket_names_ok"]
    assert single["bucket_max_err"] == 0


def test_streaming_order_and_split_invariance(single):
    assert max(float(g.abs().max()) for g in single["grads_whole"].values()) > 0
    for name, g in single["grads_whole"].items():
        torch.testing.assert_close(single["grads_streamed"][name], g, atol=1e-7, rtol=1e-5, msg=name)
    _assert_params_close(single["params_whole"], single["params_streamed"])
    whole, streamed = single["metrics_whole"], single["metrics_streamed"]
    assert streamed["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert streamed["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert whole["micro_batches"] == 1 and streamed["micro_batches"] == 3
    assert whole["tokens"] == streamed["tokens"] == whole["num_tokens"]
    assert whole["lr"] == LR


def test_packed_micro_batches_equal_padded_ones(single):
    assert single["packing"] == (True, False)
    for packed, padded in zip(single["packed_0.7"], single["padded_0.7"], strict=True):
        assert packed.shape == padded.shape
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-5)
    assert max(float(g.abs().max()) for g in single["grads_padded"].values()) > 0
    for name, g in single["grads_padded"].items():
        torch.testing.assert_close(single["grads_streamed"][name], g, atol=1e-7, rtol=1e-5, msg=name)
    assert single["metrics_padded"]["loss"] == pytest.approx(single["metrics_streamed"]["loss"], abs=1e-6)


def test_rows_sharing_their_prompt_equal_unshared_rows_and_hf(single):
    assert single["sharing"] == (True, False)
    ref_lp, ref_ent = single["grouped_hf"]
    for lp, ent in single["grouped_logprobs"]:
        assert float((lp.double() - ref_lp).abs().max()) < 1e-4 and float((ent.double() - ref_ent).abs().max()) < 1e-4
    for shared, unshared in zip(*single["grouped_logprobs"], strict=True):
        torch.testing.assert_close(shared, unshared, atol=1e-6, rtol=1e-5)
    shared, unshared = single["grouped_grads"]
    assert max(float(g.abs().max()) for g in unshared.values()) > 0
    for name, g in unshared.items():
        torch.testing.assert_close(shared[name], g, atol=1e-7, rtol=1e-5, msg=name)
    losses = [m["loss"] for m in single["grouped_metrics"]]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_forward_micro_batches_keep_their_own_shape_without_pipeline_stages(single):
    """Forward-only micro-batches of a single stage run at their own length (packed: the chunk's real tokens;
    padded: the last run's own rows); the pipeline's equal shapes (filler) give the same log-probs."""
    shapes, real = single["chunk_shapes"], single["chunk_real_tokens"]
    assert len(real) >= 2 and len(set(real)) > 1  # chunks of differing lengths
    assert shapes[(False, True)] == [(1, n) for n in real]  # packed: no filler
    assert shapes[(True, True)] == [(1, max(real))] * len(real)
    own, same = shapes[(False, False)], shapes[(True, False)]
    assert len(set(same)) == 1 and own[:-1] == same[:-1] and own[-1][0] < same[-1][0]  # padded: no copied rows
    for own_values, same_values in zip(single["packed_0.7"], single["same_shape_0.7"], strict=True):
        torch.testing.assert_close(own_values, same_values, atol=1e-6, rtol=1e-5)


def test_clear_errors(single):
    no_response, empty_step, overtaken = single["errors"]
    assert "no response tokens" in no_response
    assert "denominator" in empty_step
    assert "trained 1 micro-batches since the last step but was sent 2" in overtaken


def test_one_step_reduces_loss(single):
    assert single["loss_after"] < single["loss_before"]


def test_offload_onload_keeps_training_identical(single):
    assert single["freed"]
    assert single["offload_bytes"] == single["onload_bytes"] > 0
    assert single["cpu_noop_bytes"] == (single["state_bytes"], single["state_bytes"])
    assert single["offload_equal"]
    moved, back = single["inference_offload"]
    assert moved == back > 0 and single["inference_equal"]


def test_dp2_matches_dp1(single, dp2):
    first, _, _ = dp2
    r0, r1 = first
    for name, p in r0["params1"].items():
        assert torch.equal(p, r1["params1"][name]), name
    _assert_params_close(r0["params1"], single["dp1_params"])
    assert any(not torch.equal(single["dp1_init"][n], p) for n, p in single["dp1_params"].items())
    assert r0["metrics"]["loss"] == pytest.approx(single["dp1_metrics"]["loss"], abs=1e-6)
    assert r0["metrics"]["micro_batches"] == 3
    assert r0["metrics"] == r1["metrics"]


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}], ids=["tp2", "tp2-sp", "pp2"])
def test_model_parallel_matches_single_process(single, parallel, model_path, tmp_path):
    results = spawn(2, _model_parallel, str(tmp_path), parallel=parallel, model_path=model_path,
                    sequence_parallel=parallel.get("sp", False))
    last = results[-1]  # the last pipeline stage (either rank with TP)
    torch.testing.assert_close(last["logprobs"], single["dp1_logprobs"], atol=1e-5, rtol=1e-5)
    assert last["metrics"]["loss"] == pytest.approx(single["dp1_metrics"]["loss"], abs=1e-6)
    assert last["metrics"]["grad_norm"] == pytest.approx(single["dp1_metrics"]["grad_norm"], rel=1e-4)
    assert results[0]["metrics"] == last["metrics"]
    for got, want in zip(last["grouped"], single["grouped_logprobs"][1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    streamed = results[0]["hf"]  # the stream yields on tp0 / pp0
    assert streamed.keys() == single["dp1_hf"].keys()
    for name, t in streamed.items():
        torch.testing.assert_close(t, single["dp1_hf"][name], atol=2e-6, rtol=1e-5, msg=name)


def test_checkpoint_resume_is_exact(dp2):
    from rlinf_pipe.models.megatron_checkpoint import read_megatron_meta

    first, resumed, ckpt = dp2
    read_megatron_meta(ckpt)  # the convert module can read the model part
    for a, b in zip(first, resumed, strict=True):
        assert b["step"] == 1
        assert torch.equal(a["rng"], b["rng"])
        assert a["metrics2"] == b["metrics2"]
        for name, p in a["params2"].items():
            assert torch.equal(p, b["params2"][name]), name


def test_a_checkpoint_waits_for_a_rank_that_writes_longer_than_the_worlds_timeout(model_path, tmp_path):
    """The ranks wait for each other's files on a gloo group with a timeout of its own (checkpoint.py)."""
    ckpt = tmp_path / "ckpt"
    results = spawn(2, _save_with_a_slow_rank_zero, str(tmp_path / "run"), model_path=model_path, ckpt=str(ckpt))
    assert [r["saved"] for r in results] == [str(ckpt.resolve())] * 2 and (ckpt / "COMPLETE").exists()


def test_a_rank_that_fails_to_save_or_load_fails_every_rank_with_its_error(model_path, tmp_path):
    """No rank waits (up to the file barrier's 2 h) for one that gave up: each raises `CheckpointError` naming it."""
    ckpt = tmp_path / "ckpts" / "ckpt"
    ckpt.parent.mkdir()
    results = spawn(2, _save_and_load_failing_on_rank_one, str(tmp_path / "run"), model_path=model_path,
                    ckpt=str(ckpt))
    for r in results:
        assert "writing its files failed on 1 rank (rank 1: OSError: [Errno 28] No space left on device)" in \
            r["save_error"]
        assert r["left_after_failed_save"] == []  # no half-written folder, no final one
        assert "loading checkpoint" in r["load_error"] and "rank 1: FileNotFoundError" in r["load_error"]
        assert "rank 0" not in r["load_error"]

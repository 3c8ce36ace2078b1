"""Megatron-core on CPU with 2 gloo processes: TP=2, DP=2 + distributed optimizer, PP=2.

Each case spawns fresh processes (torch.multiprocessing, spawn) that talk over a TCP store
on 127.0.0.1; rlinf_pipe.models.megatron_cpu makes megatron-core's CUDA-only call sites
use the CPU.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

SEQ, VOCAB, MBS, SEED, STEPS = 16, 128, 2, 1234, 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rank_offset: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * rank_offset + micro)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous(),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
    }


def _train(tp: int, pp: int, dist_opt: bool, num_micro: int, steps: int) -> dict:
    """Build a tiny GPT, train ``steps`` steps on fixed batches; return losses and params."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=dist_opt, clip_grad=1.0),
        [model],
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    micro_batches = [_batch(dp_rank, m) for m in range(num_micro)]

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=num_micro,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        ok, _grad_norm, _ = optimizer.step()
        assert ok
        times.append(time.perf_counter() - t0)
        if out:
            losses.append(float(torch.stack([o["loss"] for o in out]).mean()))
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "params": params, "step_s": times[1:]}


def _worker(rank: int, world: int, port: int, case: dict, result_dir: str) -> None:
    torch.set_num_threads(1)
    from rlinf_pipe.models.megatron_cpu import enable_cpu_compat

    enable_cpu_compat()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = _train(**case)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _run(world: int, case: dict, tmp_path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, _free_port(), case, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_tp2_matches_single_process(tmp_path):
    case = dict(tp=1, pp=1, dist_opt=False, num_micro=1, steps=STEPS)
    (ref,) = _run(1, case, tmp_path / "ref")
    tp = _run(2, dict(case, tp=2), tmp_path / "tp")
    assert ref["losses"][-1] < ref["losses"][0]
    for r in tp:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_dp2_distributed_optimizer_keeps_ranks_identical(tmp_path):
    r0, r1 = _run(2, dict(tp=1, pp=1, dist_opt=True, num_micro=1, steps=STEPS), tmp_path)
    assert r0["losses"][-1] < r0["losses"][0]
    assert r0["losses"] != r1["losses"]  # different data per DP rank
    assert r0["params"].keys() == r1["params"].keys()
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


def test_pp2_two_microbatches_trains(tmp_path):
    r0, r1 = _run(2, dict(tp=1, pp=2, dist_opt=False, num_micro=2, steps=STEPS), tmp_path)
    assert r0["losses"] == []  # only the last stage sees the loss
    assert len(r1["losses"]) == STEPS
    assert r1["losses"][-1] < r1["losses"][0]

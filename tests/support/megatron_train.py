"""A tiny Megatron GPT trainer shared by the Megatron-on-CPU tests (single process and spawned groups)."""

from __future__ import annotations

import time

import torch

SEQ, VOCAB, MBS, SEED = 16, 128, 2, 1234


def micro_batch(rank_offset: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * rank_offset + micro)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous(),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
    }


def train_tiny_gpt(tp: int, pp: int, dist_opt: bool, num_micro: int, steps: int) -> dict:
    """Initialise model parallelism (tp x pp), build a tiny GPT and train `steps` steps on fixed batches with
    Megatron's DDP and optimizer; return losses (last pipeline stage only), parameters, step times, grad norms."""
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

    from rlinf_pipe.models.megatron_gpt import init_model_parallel

    init_model_parallel(tp, pp)
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
    micro_batches = [micro_batch(dp_rank, m) for m in range(num_micro)]

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    losses, times, grad_norms = [], [], []
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
        ok, grad_norm, _ = optimizer.step()
        assert ok
        grad_norms.append(grad_norm)
        times.append(time.perf_counter() - t0)
        if out:
            losses.append(float(torch.stack([o["loss"] for o in out]).mean()))
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "params": params, "step_s": times[1:], "grad_norms": grad_norms}

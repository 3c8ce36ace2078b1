"""A megatron-core GPTModel built from a Hugging Face config (Llama, Qwen2 and Qwen3 families; `models.arch`).

`gpt_config_from_hf` maps the HF config to a `TransformerConfig` (RMSNorm, SwiGLU, RoPE with the
checkpoint's theta, GQA, Qwen2's q/k/v bias, Qwen3's per-head q/k norms and explicit head size, tied or untied
embeddings); `build_gpt_model` builds this rank's pipeline stage once `megatron.core.parallel_state` is
initialised, its rotary frequencies those of transformers (Llama 3's scaled ones included). Weights are random until
`rlinf_pipe.models.live_weights` loads a checkpoint into them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlinf_pipe.models.arch import check_parallel_sizes, hf_arch, padded_vocab_size
from rlinf_pipe.models.megatron_import import import_megatron_core
from rlinf_pipe.models.rotary import inverse_frequencies


RECOMPUTE = ("none", "selective", "full")


def recompute_options(recompute: str) -> dict[str, Any]:
    """`TransformerConfig` fields of an activation-recompute choice: `selective` recomputes the attention core
    (the scores and softmax, which grow with the square of the sequence); `full` every layer's activations (each
    layer keeps only its input)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def gpt_config_from_hf(
    hf_config: Any, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32, recompute: str = "none",
    sequence_parallel: bool = False, cp: int = 1,
) -> Any:
    """The megatron `TransformerConfig` equivalent to `hf_config` for a TP x PP x CP split (`sequence_parallel`:
    needs TP > 1)."""
    import_megatron_core()
    from megatron.core.transformer import TransformerConfig

    arch = hf_arch(hf_config)
    check_parallel_sizes(arch, tp, pp)
    if sequence_parallel and tp < 2:
        raise ValueError("sequence parallelism splits the sequence over the tensor-parallel ranks: it needs TP >= 2")
    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **recompute_options(recompute),
    )


def init_model_parallel(tp: int, pp: int, cp: int = 1) -> None:
    """Megatron's parallel state over this process's torch.distributed world (tensor-parallel fastest, then
    context-parallel, then data-parallel, then pipeline), once. Every Megatron process calls it first: without CUDA it also enables the
    megatron-core CPU patches (`megatron_cpu.enable_cpu_compat`; a no-op with CUDA)."""
    import_megatron_core()
    from megatron.core import parallel_state as ps

    from rlinf_pipe.models.megatron_cpu import enable_cpu_compat

    enable_cpu_compat()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp)


def build_gpt_model(
    hf_config: Any, *, params_dtype: torch.dtype = torch.float32, pre_process: bool | None = None,
    post_process: bool | None = None, recompute: str = "none", sequence_parallel: bool = False,
) -> Any:
    """This rank's `GPTModel` stage for `hf_config`, with TP/PP sizes taken from `parallel_state`.

    Call after `init_model_parallel` (which also enables the CPU patches that `GPTModel.__init__` needs without
    CUDA).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from rlinf_pipe.models import megatron_rope
    from rlinf_pipe.models.megatron_norm import HeadRMSNorm, SequenceRMSNorm
    from rlinf_pipe.models.megatron_sdpa import SdpaAttention

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: call rlinf_pipe.models.megatron_gpt.init_model_parallel(tp, pp) first")
    arch = hf_arch(hf_config)
    config = gpt_config_from_hf(
        hf_config,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        cp=ps.get_context_parallel_world_size(),
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    # the norms: torch's RMSNorm, marked for sequence parallelism (megatron_norm.py)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceRMSNorm
    if arch.qk_norm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    # attention on torch's fused kernel, which also takes packed sequences (megatron_sdpa.py)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    # The block's final norm is the layers' own: given a layer spec, Megatron picks it from what is installed
    # (Transformer Engine's TENorm, else apex's FusedLayerNorm, which refuses RMSNorm, else torch's).
    block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                       layer_norm=spec.submodules.input_layernorm)
    megatron_rope.install()  # (the rotary embedding: cos / sin once per forward, packed streams in one gather)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rotary_percent=1.0,
        parallel_output=True,
    )
    if arch.rope_scaling is not None:  # (transformers' Llama 3 frequencies, not Megatron's own approximation of them)
        model.rotary_pos_emb.inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    with torch.no_grad():  # the torch-norm fallback (no apex / Transformer Engine) makes fp32 norm weights whatever
        for param in model.parameters():  # params_dtype is; one dtype for all, as Megatron's Float16Module casts
            if param.is_floating_point() and param.dtype != params_dtype:
                param.data = param.data.to(params_dtype)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model

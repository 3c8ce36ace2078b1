"""A megatron-core GPTModel built from a Hugging Face config (Llama and Qwen2 families).

`gpt_config_from_hf` maps the HF config to a `TransformerConfig` (RMSNorm, SwiGLU, RoPE with the
checkpoint's theta, GQA, Qwen2's q/k/v bias, tied or untied embeddings); `build_gpt_model` builds this
rank's pipeline stage once `megatron.core.parallel_state` is initialised. Weights are random until
`rlinf_pipe.models.live_weights` loads a checkpoint into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlinf_pipe.models.hf_config import MODEL_TYPES, ROPE_KEYS, rope_of
from rlinf_pipe.models.megatron_import import import_megatron_core


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or feature the Megatron builder does not support."""


@dataclass(frozen=True)
class HfArch:
    """What the Megatron builder and the weight converter need to know about an HF checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool


def _rope_theta(hf_config: Any) -> float:
    rope = rope_of({key: getattr(hf_config, key, None) for key in ROPE_KEYS})
    if rope.kind != "default":
        raise UnsupportedModelError(f"RoPE scaling {rope.kind!r} is not supported (only the default RoPE)")
    if rope.partial_factor != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {rope.partial_factor} is not supported (only RoPE over whole heads)")
    if rope.theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta")
    return rope.theta


def hf_arch(hf_config: Any) -> HfArch:
    """Read and check the architecture facts of an HF `PretrainedConfig` (Llama or Qwen2)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
    if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError("Qwen2 sliding-window attention is not supported")
    if model_type == "llama" and getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("Llama mlp_bias=True is not supported")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return HfArch(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocabulary: the HF vocabulary rounded up to a multiple of `tp` (rows past the HF
    vocabulary are zero and their logits must be masked out before any softmax)."""
    return -(-vocab_size // tp) * tp


def check_parallel_sizes(arch: HfArch, tp: int, pp: int) -> None:
    """Raise `UnsupportedModelError` naming the size that does not divide the model."""
    problems = []
    if arch.num_heads % tp:
        problems.append(f"num_attention_heads {arch.num_heads}")
    if arch.num_kv_heads % tp:
        problems.append(f"num_key_value_heads {arch.num_kv_heads}")
    if arch.intermediate_size % tp:
        problems.append(f"intermediate_size {arch.intermediate_size}")
    if problems:
        raise UnsupportedModelError(
            f"tensor_parallel_size {tp} must divide {', '.join(problems)}; pick a TP size that divides them"
        )
    if arch.num_layers % pp:
        raise UnsupportedModelError(
            f"pipeline_parallel_size {pp} must divide num_hidden_layers {arch.num_layers}; "
            "pick a PP size that divides it"
        )


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
) -> Any:
    """The megatron `TransformerConfig` equivalent to `hf_config` for a TP x PP split."""
    import_megatron_core()
    from megatron.core.transformer import TransformerConfig

    arch = hf_arch(hf_config)
    check_parallel_sizes(arch, tp, pp)
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
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **recompute_options(recompute),
    )


def init_model_parallel(tp: int, pp: int) -> None:
    """Megatron's parallel state over this process's torch.distributed world (tensor-parallel fastest, then data-
    parallel, then pipeline), once. Every Megatron process calls it first: without CUDA it also enables the
    megatron-core CPU patches (`megatron_cpu.enable_cpu_compat`; a no-op with CUDA)."""
    import_megatron_core()
    from megatron.core import parallel_state as ps

    from rlinf_pipe.models.megatron_cpu import enable_cpu_compat

    enable_cpu_compat()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt_model(
    hf_config: Any, *, params_dtype: torch.dtype = torch.float32, pre_process: bool | None = None,
    post_process: bool | None = None, recompute: str = "none",
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
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
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
    with torch.no_grad():  # the torch-norm fallback (no apex / Transformer Engine) makes fp32 norm weights whatever
        for param in model.parameters():  # params_dtype is; one dtype for all, as Megatron's Float16Module casts
            if param.is_floating_point() and param.dtype != params_dtype:
                param.data = param.data.to(params_dtype)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model

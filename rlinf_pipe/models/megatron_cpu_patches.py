"""The call sites of megatron-core that `megatron_cpu` patches for CPU: one `Patch` record each (target, kind,
the fragments of its source to replace or the CPU function that replaces it, and why), and those CPU functions.
When a megatron-core upgrade changes a target, `megatron_cpu.check_patches` names it and this table is what to
update (docs/megatron-cpu.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# --------------------------------------------------------------------------------------
# CPU implementations used by "replace" patches
# --------------------------------------------------------------------------------------


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    """CPU stand-in for tensor_parallel.random._get_cuda_rng_state: the CPU default
    generator plays the role of the current CUDA generator."""
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    """CPU stand-in for tensor_parallel.random._set_cuda_rng_state."""
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.set_rng_state(new_state)


# --------------------------------------------------------------------------------------
# Patch records
# --------------------------------------------------------------------------------------


@dataclass
class Patch:
    """One patched call site.

    ``target`` is ``"<module>:<qualname>"`` (qualname may be ``Class.method``).
    ``kind`` is ``"replace"`` (``replacement`` + ``params``) or ``"edit"`` (``edits``:
    ``(old, new, count)`` fragments of the target's source).
    ``aliases`` are other ``"<module>:<attr>"`` names that re-export the same object
    and must follow the patch.
    """

    name: str
    target: str
    reason: str
    kind: str
    edits: tuple[tuple[str, str, int], ...] = ()
    replacement: Callable | None = None
    params: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    # filled in when applied
    original: Any = field(default=None, repr=False)
    patched: Any = field(default=None, repr=False)
    rebound: list = field(default_factory=list, repr=False)

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


_CUDA_DEV = "device=torch.cuda.current_device()"
_CPU_DEV = 'device="cpu"'
_CUDA_HALF_TYPES = "if {name}.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:"
_CPU_HALF_TYPES = "if {name}.type() in ['torch.HalfTensor', 'torch.BFloat16Tensor']:"

PATCHES: list[Patch] = [
    # ---- 1. RNG: model_parallel_cuda_manual_seed and the CUDA RNG tracker ----
    Patch(
        name="rng-get-state",
        target="megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        kind="replace",
        replacement=_cpu_get_rng_state,
        params=("device", "clone", "graph_safe"),
        reason="reads torch.cuda generator state; on CPU the CPU default generator is the "
        "tracked generator (used by the tracker's fork and activation recompute)",
    ),
    Patch(
        name="rng-set-state",
        target="megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        kind="replace",
        replacement=_cpu_set_rng_state,
        params=("new_state", "device", "graph_safe"),
        reason="writes torch.cuda generator state; on CPU it sets the CPU default generator",
    ),
    Patch(
        name="rng-tracker-add",
        target="megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add",
        kind="edit",
        edits=(
            ("torch.cuda.get_rng_state()", "torch.get_rng_state()", 2),
            ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)", 1),
        ),
        reason="creates each named RNG state with torch.cuda.manual_seed/get_rng_state; "
        "on CPU the state is made with the CPU generator",
    ),
    Patch(
        name="rng-tracker-fork",
        target="megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        kind="edit",
        edits=(
            (
                "if not torch.all(cpu_rng_state == torch.get_rng_state()).item():",
                "if False:  # rlinf_pipe megatron_cpu: the CPU generator is the tracked one",
                1,
            ),
        ),
        reason="warns when the CPU RNG changes inside a fork; on CPU the forked generator IS "
        "the CPU generator, so the warning would fire on every use (state swap itself is "
        "handled by rng-get-state/rng-set-state)",
    ),
    Patch(
        name="rng-manual-seed",
        target="megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed",
        kind="edit",
        edits=(
            ("torch.cuda.manual_seed(data_parallel_seed)", "torch.manual_seed(data_parallel_seed)", 1),
        ),
        aliases=("megatron.core.tensor_parallel:model_parallel_cuda_manual_seed",),
        reason="seeds the default CUDA generator; on CPU it seeds the CPU generator",
    ),
    # ---- 2. GlobalMemoryBuffer (attention scratch buffers) ----
    Patch(
        name="global-memory-buffer",
        target="megatron.core.utils:GlobalMemoryBuffer.get_tensor",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 1),),
        reason="allocates the shared scratch buffer on torch.cuda.current_device()",
    ),
    Patch(
        name="local-l2-norm",
        target="megatron.core.utils:local_multi_tensor_l2_norm",
        kind="edit",
        edits=(('dtype=torch.float, device="cuda"', 'dtype=torch.float, device="cpu"', 1),),
        reason='torch fallback of amp_C.multi_tensor_l2norm (used by clip_grads without apex/TE) '
        'returns the norm with device="cuda"',
    ),
    # ---- 3. schedules: token counter tensor ----
    *[
        Patch(
            name=f"schedules-{short}",
            target=f"megatron.core.pipeline_parallel.schedules:{fn}",
            kind="edit",
            edits=(
                (
                    'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',
                    'total_num_tokens = torch.zeros([], dtype=torch.int, device="cpu")',
                    1,
                ),
            ),
            reason='allocates the total_num_tokens counter with device="cuda"',
        )
        for short, fn in (
            ("no-pipelining", "forward_backward_no_pipelining"),
            ("interleaved", "forward_backward_pipelining_with_interleaving"),
            ("1f1b", "forward_backward_pipelining_without_interleaving"),
        )
    ],
    # ---- 3b. p2p communication (PP): receive buffers and the post-batch sync ----
    Patch(
        name="p2p-communicate",
        target="megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 2), ("torch.cuda.synchronize()", "pass", 1)),
        reason="allocates pipeline receive buffers on torch.cuda.current_device() and calls "
        "torch.cuda.synchronize() after batched isend/irecv",
    ),
    # ---- 4. DDP wrapper: contiguous param/grad buffers ----
    Patch(
        name="param-and-grad-buffer",
        target="megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 3),),
        reason="allocates the contiguous param/grad buffers on torch.cuda.current_device() "
        "(the CUDA streams in this file are only used with several distributed-optimizer "
        "instances and are left alone)",
    ),
    # ---- 5. clip_grads: grad norm, clipping, zero counting ----
    Patch(
        name="clip-grads-norm",
        target="megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
        kind="edit",
        edits=(("device='cuda'", "device='cpu'", 3),),
        reason="allocates the norm / overflow tensors with device='cuda'",
    ),
    Patch(
        name="clip-grads-clip",
        target="megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        kind="edit",
        edits=(
            ("param.grad.type() == 'torch.cuda.FloatTensor'", "param.grad.type() == 'torch.FloatTensor'", 1),
            ("device='cuda'", "device='cpu'", 1),
        ),
        reason="asserts grads are torch.cuda.FloatTensor and allocates an overflow buffer "
        "with device='cuda'",
    ),
    Patch(
        name="clip-grads-count-zeros",
        target="megatron.core.optimizer.clip_grads:count_zeros_fp32",
        kind="edit",
        edits=(("device='cuda'", "device='cpu'", 1),),
        reason="allocates the zero counter with device='cuda'",
    ),
    # ---- Megatron optimizer wrappers (reached by get_megatron_optimizer on fp32) ----
    Patch(
        name="optimizer-mixed-precision-init",
        target="megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__",
        kind="edit",
        edits=(("device='cuda'", "device='cpu'", 3),),
        reason="allocates found_inf / overflow / unit-scale tensors with device='cuda' "
        "(base class of the distributed optimizer)",
    ),
    Patch(
        name="optimizer-fp32-init",
        target="megatron.core.optimizer.optimizer:FP32Optimizer.__init__",
        kind="edit",
        edits=(("device='cuda'", "device='cpu'", 1),),
        reason="allocates the unit loss-scale tensor with device='cuda'",
    ),
    Patch(
        name="optimizer-chained-loss-scale",
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.get_loss_scale",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 1),),
        reason="allocates the default loss scale on torch.cuda.current_device()",
    ),
    # ---- 6. distributed optimizer: wrapped-parameter type check ----
    Patch(
        name="distrib-optimizer-param-type",
        target="megatron.core.optimizer.distrib_optimizer:"
        "DistributedOptimizer._build_model_and_main_param_groups",
        kind="edit",
        edits=(
            (
                "elif model_param.type() == 'torch.cuda.FloatTensor':",
                "elif model_param.type() == 'torch.FloatTensor':",
                1,
            ),
            (_CUDA_HALF_TYPES.format(name="model_param"), _CPU_HALF_TYPES.format(name="model_param"), 1),
        ),
        reason="accepts only torch.cuda.FloatTensor/HalfTensor/BFloat16Tensor parameters; "
        "on CPU parameters are torch.FloatTensor / torch.BFloat16Tensor",
    ),
    Patch(
        name="distrib-optimizer-init-half-params",
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        kind="edit",
        edits=((_CUDA_HALF_TYPES.format(name="param"), _CPU_HALF_TYPES.format(name="param"), 1),),
        reason="marks 16-bit parameters for a sharded fp32 main copy only if they are torch.cuda "
        "HalfTensor/BFloat16Tensor; on CPU they are torch.BFloat16Tensor",
    ),
    Patch(
        name="float16-optimizer-param-types",
        target="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        kind="edit",
        edits=(
            (_CUDA_HALF_TYPES.format(name="param"), _CPU_HALF_TYPES.format(name="param"), 1),
            ("elif param.type() == 'torch.cuda.FloatTensor':", "elif param.type() == 'torch.FloatTensor':", 1),
        ),
        reason="the bf16 optimizer (fp32 master copies of bf16 parameters, DP=1) accepts only torch.cuda "
        "tensor types; on CPU they are torch.BFloat16Tensor / torch.FloatTensor",
    ),
    # ---- 7. GPT model: RoPE table and the tied-embedding copy on the last PP stage ----
    Patch(
        name="rotary-get-emb",
        target="megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 1),),
        reason="moves a CPU inv_freq to torch.cuda.current_device() on the first forward "
        "(inv_freq is built on CPU with use_cpu_initialization); on CPU it stays there",
    ),
    Patch(
        name="language-module-tied-embedding",
        target="megatron.core.models.common.language_module.language_module:"
        "LanguageModule.setup_embeddings_and_output_layer",
        kind="edit",
        edits=(
            (
                "weight.data = weight.data.cuda()",
                "pass  # rlinf_pipe megatron_cpu: the weight stays on CPU (gloo all-reduce)",
                1,
            ),
        ),
        reason="with tied embeddings and PP>1, moves the shared embedding/output weight to "
        "CUDA before the first/last-stage all-reduce that copies it; on CPU the all-reduce "
        "runs on the CPU weight (run by GPTModel.__init__)",
    ),
    # ---- 8. sequence parallelism: the sequence's gather and reduce-scatter over the TP group ----
    Patch(
        name="sequence-parallel-gather",
        target="megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 2),),
        reason="allocates the gathered sequence on torch.cuda.current_device() (gloo gathers into a CPU tensor)",
    ),
    Patch(
        name="sequence-parallel-reduce-scatter",
        target="megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 1),),
        reason="allocates each rank's reduced slice of the sequence on torch.cuda.current_device()",
    ),
    Patch(
        name="sequence-parallel-linear-backward",
        target="megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward",
        kind="edit",
        edits=((_CUDA_DEV, _CPU_DEV, 3),),
        reason="the backward of a sequence-parallel linear layer allocates the reduce-scattered input gradient (and, "
        "with gradient-accumulation fusion, a weight gradient) on torch.cuda.current_device()",
    ),
]

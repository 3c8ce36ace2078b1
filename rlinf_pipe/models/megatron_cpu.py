"""CPU compatibility layer for megatron-core (development and CI machines without CUDA).

megatron-core assumes CUDA in a handful of places: it seeds and forks the CUDA RNG, it
allocates a few buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` or checks
that parameters are ``torch.cuda.FloatTensor``, and it moves a few model tensors to CUDA
(the RoPE ``inv_freq``, the tied embedding copy on the last pipeline stage).  Everything else (TP/PP/DP collectives,
the Megatron optimizer, the distributed optimizer) works on gloo with CPU tensors.

``enable_cpu_compat()`` patches exactly those call sites and nothing else:

* It is a no-op (returns ``False``) when ``torch.cuda.is_available()``: on CUDA nothing
  is patched.
* Each patch is recorded in ``PATCHES`` (name, target, reason); ``describe_patches()``
  lists them.
* Each patch verifies its target before touching it.  Two kinds exist:

  - *replace*: the target function is swapped for a CPU implementation written here;
    the target's parameter names must match the ones we expect.
  - *edit*: the target function's own source is taken from the installed megatron-core,
    specific fragments (e.g. ``device="cuda"``) are replaced by CPU equivalents, and the
    result is compiled in the target module's namespace.  Every fragment must occur
    exactly the expected number of times.  This keeps the rest of megatron's logic
    as-is (no copy of megatron code lives in this repository) and makes a changed
    call site impossible to miss.

  If a check fails, ``MegatronCpuCompatError`` names the patch and the megatron-core
  version: "megatron-core X changed <target>; update rlinf_pipe/models/megatron_cpu.py".
* Supported megatron-core range: ``SUPPORTED_VERSIONS`` (0.16.x).  Other versions only
  warn; the per-patch checks still run and are what actually decides.

No ``TorchFunctionMode`` and no global torch patch is used: all patches are per call site.
See docs/megatron-cpu.md.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "SUPPORTED_VERSIONS",
    "MegatronCpuCompatError",
    "Patch",
    "PATCHES",
    "enable_cpu_compat",
    "disable_cpu_compat",
    "is_enabled",
    "check_patches",
    "describe_patches",
    "megatron_core_version",
]

# Supported megatron-core versions: (major, minor) pairs. 0.17+ needs Python >= 3.12.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 16),)

_THIS_FILE = "rlinf_pipe/models/megatron_cpu.py"


class MegatronCpuCompatError(RuntimeError):
    """A patch target is missing or no longer has the shape this module expects."""


def megatron_core_version() -> str:
    from rlinf_pipe.models.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core import package_info

    return package_info.__version__


def _version_supported(version: str) -> bool:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in SUPPORTED_VERSIONS


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
]

_lock = threading.Lock()
_enabled = False


# --------------------------------------------------------------------------------------
# Checking and applying
# --------------------------------------------------------------------------------------


def _fail(patch: Patch, detail: str) -> MegatronCpuCompatError:
    version = _safe_version()
    return MegatronCpuCompatError(
        f"megatron-core {version} changed {patch.target} (patch '{patch.name}': {detail}); "
        f"update {_THIS_FILE}"
    )


def _safe_version() -> str:
    try:
        return megatron_core_version()
    except Exception:  # pragma: no cover - megatron not importable
        return "<unknown>"


def _resolve(patch: Patch) -> tuple[Any, str, Any]:
    """Return (owner, attribute name, raw attribute) for the patch target."""
    try:
        module = importlib.import_module(patch.module_name)
    except ImportError as exc:
        raise _fail(patch, f"module cannot be imported: {exc}") from exc
    owner: Any = module
    parts = patch.qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise _fail(patch, f"'{part}' no longer exists")
    attr = parts[-1]
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        raise _fail(patch, f"'{attr}' no longer exists")
    return owner, attr, raw


def _function_of(raw: Any) -> Callable:
    """Underlying plain function of a (static/class)method or decorated function."""
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    return inspect.unwrap(raw)


def _current_source(patch: Patch, raw: Any) -> str:
    func = _function_of(raw)
    try:
        return textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise _fail(patch, f"source not available: {exc}") from exc


def _check(patch: Patch) -> tuple[Any, str, Any]:
    owner, attr, raw = _resolve(patch)
    if patch.patched is not None and raw is patch.patched:
        # already applied: check the original we replaced
        raw = patch.original
    func = _function_of(raw)
    if not callable(func):
        raise _fail(patch, "target is not a function")
    if patch.kind == "replace":
        params = tuple(inspect.signature(func).parameters)
        if params != patch.params:
            raise _fail(patch, f"signature is {params}, expected {patch.params}")
    elif patch.kind == "edit":
        src = _current_source(patch, raw)
        for old, _new, count in patch.edits:
            found = src.count(old)
            if found != count:
                raise _fail(patch, f"expected {count} occurrence(s) of {old!r}, found {found}")
        if "__class__" in src:
            raise _fail(patch, "source uses __class__ explicitly; cannot be recompiled")
    else:  # pragma: no cover - programming error
        raise ValueError(f"unknown patch kind {patch.kind!r}")
    for alias in patch.aliases:
        mod_name, alias_attr = alias.split(":", 1)
        mod = importlib.import_module(mod_name)
        current = getattr(mod, alias_attr, None)
        if current is not raw and (patch.patched is None or current is not patch.patched):
            raise _fail(patch, f"alias {alias} no longer refers to the target")
    return owner, attr, raw


def _build_edited(patch: Patch, owner: Any, raw: Any) -> Any:
    src = _current_source(patch, raw)
    for old, new, _count in patch.edits:
        src = src.replace(old, new)
    func = _function_of(raw)
    module = sys.modules[func.__module__]
    # Compile inside a factory taking ``__class__`` so that zero-argument super() in
    # methods keeps working after recompilation.
    factory_src = (
        "def __rlinf_factory__(__class__):\n"
        + textwrap.indent(src, "    ")
        + f"\n    return {func.__name__}\n"
    )
    filename = f"<megatron_cpu patch {patch.name}: {inspect.getsourcefile(func)}>"
    code = compile(factory_src, filename, "exec")
    scope: dict[str, Any] = {}
    exec(code, module.__dict__, scope)  # noqa: S102 - megatron's own source, edited
    cls = owner if isinstance(owner, type) else None
    new = scope["__rlinf_factory__"](cls)
    new_func = _function_of(new)
    new_func.__qualname__ = func.__qualname__
    new_func.__doc__ = func.__doc__
    new_func.__rlinf_cpu_patch__ = patch.name
    return new


def _rebind_imported_names(old: Any, new: Any) -> list[tuple[Any, str]]:
    """``from x import f [as g]`` copies ``f`` into the importing module: rebind those
    copies (module-level names bound to the very same object) in already-imported
    megatron modules. Modules imported later pick up the patched attribute themselves."""
    rebound = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron"):
            continue
        for name, value in list(getattr(mod, "__dict__", {}).items()):
            if value is old:
                setattr(mod, name, new)
                rebound.append((mod, name))
    return rebound


def check_patches() -> list[str]:
    """Verify that every patch target exists with the expected shape (whether or not
    the patches are applied, and whether or not CUDA is present). Raises
    ``MegatronCpuCompatError`` naming the first broken patch; returns the patch names."""
    for patch in PATCHES:
        _check(patch)
    return [p.name for p in PATCHES]


def _version_guard() -> None:
    version = megatron_core_version()
    if not _version_supported(version):
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
        warnings.warn(
            f"megatron-core {version} is outside the range supported by {_THIS_FILE} "
            f"({supported}); the per-call-site checks still run",
            RuntimeWarning,
            stacklevel=3,
        )


def enable_cpu_compat() -> bool:
    """Patch megatron-core's CUDA-only call sites for CPU use.

    Returns ``True`` when the patches are active (first call or already applied) and
    ``False`` when CUDA is available (nothing is patched). Idempotent and thread-safe.
    Raises ``MegatronCpuCompatError`` if megatron-core changed one of the targets; in
    that case nothing is patched.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        _version_guard()
        checked = [(patch, *_check(patch)) for patch in PATCHES]  # all or nothing
        built = []
        for patch, owner, attr, raw in checked:
            if patch.kind == "replace":
                new = patch.replacement
            else:
                new = _build_edited(patch, owner, raw)
            built.append((patch, owner, attr, raw, new))
        for patch, owner, attr, raw, new in built:
            patch.original = raw
            patch.patched = new
            setattr(owner, attr, new)
            for alias in patch.aliases:
                mod_name, alias_attr = alias.split(":", 1)
                setattr(importlib.import_module(mod_name), alias_attr, new)
            if not isinstance(owner, type):
                patch.rebound = _rebind_imported_names(raw, new)
        _enabled = True
        return True


def disable_cpu_compat() -> None:
    """Restore every patched target (mainly for tests)."""
    global _enabled
    with _lock:
        if not _enabled:
            return
        for patch in reversed(PATCHES):
            owner, attr, _raw = _resolve(patch)
            setattr(owner, attr, patch.original)
            for alias in patch.aliases:
                mod_name, alias_attr = alias.split(":", 1)
                setattr(importlib.import_module(mod_name), alias_attr, patch.original)
            for mod, name in patch.rebound:
                setattr(mod, name, patch.original)
            patch.original = patch.patched = None
            patch.rebound = []
        _enabled = False


def is_enabled() -> bool:
    return _enabled


def describe_patches() -> list[dict[str, str]]:
    """One entry per patch: name, target, kind, reason, applied."""
    return [
        {
            "name": p.name,
            "target": p.target,
            "kind": p.kind,
            "reason": p.reason,
            "applied": str(_enabled),
        }
        for p in PATCHES
    ]

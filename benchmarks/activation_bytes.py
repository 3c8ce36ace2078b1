"""Bytes a Megatron layer saves for its backward, counted on CPU, against the memory estimate's `layer_activations`.

    python benchmarks/activation_bytes.py [--tokens 1024] [--hidden 768] [--heads 6] [--kv-heads 1]
        [--intermediate 4480] [--recompute selective] [--json]

Runs one training micro-batch of `tokens` tokens (bf16 parameters, the local layer spec, as on GPUs; its backward
skipped, as the count needs the forward alone) on a model with these
widths (the defaults keep DeepSeek-R1-Distill-Qwen-1.5B's ratios: head_dim 128, 6 query heads per KV head, a gated
MLP 5.8x the hidden size) and counts, with saved-tensor hooks, the distinct storages that the forward pass saves
for backward (parameters excluded). Two models, of one and two layers, give one layer's share as their difference.
On CPU the norms are not fused (torch's RMSNorm composite keeps float32 intermediates that CUDA's fused kernel and
Apex do not); `norm_fp32` reports that part separately, and `per_layer_fused` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from transformers import AutoConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from support.actor_run import LOSS, one_sequence_batch, spawn  # noqa: E402

from rlinf_pipe.models.arch import hf_arch  # noqa: E402
from rlinf_pipe.models.tiny import ensure_tiny_model  # noqa: E402
from rlinf_pipe.planning.model_sizes import layer_activations  # noqa: E402


def _saved_bytes_each(rank: int, model_paths: list[str], tokens: int, recompute: str) -> list[dict]:
    """`_saved_bytes` of each model, in one spawned rank (its imports paid once)."""
    return [_saved_bytes(path, tokens, recompute) for path in model_paths]


def _saved_bytes(model_path: str, tokens: int, recompute: str) -> dict:
    """Distinct non-parameter storages saved by the forward pass of one training micro-batch."""
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_path, lr=1e-6, params_dtype="bfloat16", recompute=recompute, load_weights=False)
    params = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    batch = one_sequence_batch(policy.vocab_size, tokens)
    saved: dict[int, tuple[int, str, int]] = {}
    backward = {"started": False}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not backward["started"] and storage.data_ptr() not in params:  # recomputation in backward is transient
            saved[storage.data_ptr()] = (storage.nbytes(), str(t.dtype), t.shape[-1])
        return t

    run_backward = torch.autograd.backward

    def no_backward(*args, **kwargs) -> None:
        """The count is the forward's: the backward's arithmetic (bf16 matmuls, slow on CPU) is skipped."""
        backward["started"] = True

    torch.autograd.backward = no_backward
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            policy.train_micro_batch(batch, LOSS)
    finally:
        torch.autograd.backward = run_backward
    hidden = policy.module.config.hidden_size
    return {"total": sum(b for b, _, _ in saved.values()),
            "norm_fp32": sum(b for b, dtype, width in saved.values() if dtype == "torch.float32" and width == hidden)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--intermediate", type=int, default=4480)
    parser.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="activation_bytes_")
    folders = [str(ensure_tiny_model(os.path.join(out, "models"), hidden_size=args.hidden, num_layers=layers,
                                     num_heads=args.heads, num_kv_heads=args.kv_heads,
                                     intermediate_size=args.intermediate,
                                     max_position_embeddings=max(512, args.tokens)))
               for layers in (1, 2)]
    (counts,) = spawn(1, _saved_bytes_each, os.path.join(out, "run"), model_paths=folders, tokens=args.tokens,
                      recompute=args.recompute)
    folder = folders[-1]
    per_layer = (counts[1]["total"] - counts[0]["total"]) / args.tokens
    norm_fp32 = (counts[1]["norm_fp32"] - counts[0]["norm_fp32"]) / args.tokens
    estimate = layer_activations(hf_arch(AutoConfig.from_pretrained(folder)), 1)  # (the layers' widths)
    summary = {"per_layer": round(per_layer), "norm_fp32": round(norm_fp32),
               "per_layer_fused": round(per_layer - norm_fp32), "layer_activations": round(estimate),
               "ratio_estimate_vs_fused": round(estimate / (per_layer - norm_fp32), 3),
               "hidden": args.hidden, "intermediate": args.intermediate, "recompute": args.recompute}
    print(f"one layer saves {per_layer:,.0f} bytes a token ({per_layer / args.hidden:.1f} x hidden), "
          f"{norm_fp32:,.0f} of them the unfused norms' float32 intermediates; the estimate counts {estimate:,.0f} "
          f"({summary['ratio_estimate_vs_fused']}x the fused figure)")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""`rlinf-pipe` command line: `plan` (validate config + placement, show the GPU grid), `train` (run a config),
`eval` (a model's pass@1 / pass@k on a dataset), `timeline` (where a run's time went) and `convert` (HF <->
Megatron checkpoint folders)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from rlinf_pipe.errors import RlinfPipeError, RunStopped


def exit_on_user_error(fn: Callable[..., Any], *args: Any) -> int:
    """Run `fn(*args)`; a user error (bad config, placement, cluster) prints `error: ...` and returns 2; a run
    stopped by a signal prints where it stopped and returns 128 + the signal (130: SIGINT, 143: SIGTERM)."""
    try:
        result = fn(*args)
    except RunStopped as exc:
        print(f"rlinf-pipe: {exc}", file=sys.stderr)
        return exc.exit_code
    except RlinfPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlinf-pipe: interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


SHIPPED_CONFIGS = "examples/math/config"


def shipped_config_path() -> str:
    """Where `--config-name` looks when no `--config-path` is given: `examples/math/config` under the current folder,
    else that of the checkout this package runs from (so the shipped configs are found from any folder)."""
    from pathlib import Path

    if Path(SHIPPED_CONFIGS).is_dir():
        return SHIPPED_CONFIGS
    return str(Path(__file__).resolve().parents[1] / SHIPPED_CONFIGS)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-path", default=None,
                        help=f"folder of YAML configs (default: {SHIPPED_CONFIGS}, the shipped ones, from any folder)")
    parser.add_argument(
        "--config-name",
        default=None,
        help="config file name without .yaml (default: the embedded tiny CPU pipeline config)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="[FILE.yaml] key=value",
        help="a config file (instead of --config-path/--config-name), then dotlist overrides, e.g. runner.max_steps=5",
    )


def load_cli_config(args: argparse.Namespace) -> Any:
    """The config named on the command line: `FILE.yaml key=value ...`, or `--config-path/--config-name` and
    overrides. A first word without `=` is a config file; one that does not exist is a clear error (naming
    `--config-name` when a shipped config has that name)."""
    from pathlib import Path

    from rlinf_pipe.config import load_config
    from rlinf_pipe.errors import ConfigError

    overrides = list(args.overrides)
    config_path = args.config_path or shipped_config_path()
    if overrides and "=" not in overrides[0]:
        file = Path(overrides.pop(0))
        if args.config_name:
            raise ConfigError(f"{file}: give the config either as a file or with --config-name, not both")
        if not file.is_file():
            shipped = Path(config_path) / f"{file.name}.yaml"
            if file.suffix not in (".yaml", ".yml") and len(file.parts) == 1 and shipped.is_file():
                raise ConfigError(f"{file}: no such config file; the shipped config of that name is "
                                  f"`--config-name {file}` ({shipped})")
            hint = "" if file.suffix in (".yaml", ".yml") else "; overrides look like key=value"
            raise ConfigError(f"{file}: no such config file{hint}")
        return load_config(file.parent, file.name, overrides)
    return load_config(config_path, args.config_name, overrides)


def _planning_costs(args: argparse.Namespace, cfg: Any) -> Any:
    """The costs `--costs`, `--profile` or the default give (`--gpu`: the defaults' GPU)."""
    from rlinf_pipe.planning.costs import default_costs
    from rlinf_pipe.planning.profile import default_gpu
    from rlinf_pipe.planning.profile_pool import read_profiles
    from rlinf_pipe.planning.rlinf_costs import parse_costs, rlinf_costs

    gpu = args.gpu or default_gpu(cfg)
    if args.costs:
        actor_s, rollout_s, inference_s = parse_costs(args.costs)
        return rlinf_costs(actor_s, rollout_s, inference_s, sum(cfg.gpus_per_node()), cfg, gpu)
    if args.profile:
        return read_profiles(args.profile, gpu)
    return default_costs(cfg, gpu)


def _cluster_overrides(gpus: int | None) -> list[str]:
    """`--gpus N` as cluster keys: one node of N GPUs up to 8, else N / 8 nodes of 8."""
    from rlinf_pipe.errors import ConfigError

    if gpus is None:
        return []
    if gpus < 1 or (gpus > 8 and gpus % 8):
        raise ConfigError(f"--gpus {gpus}: give 1 to 8, or a multiple of 8 (nodes of 8 GPUs); for other shapes set "
                          "cluster.num_nodes and cluster.num_gpus_per_node instead")
    return [f"cluster.num_nodes={max(1, gpus // 8)}", f"cluster.num_gpus_per_node={min(gpus, 8)}"]


def _plan_search(args: argparse.Namespace) -> int:
    """`plan --search`: the ranked candidates (planning/search.py), printed by planning/search_report.py."""
    from rlinf_pipe.planning.costs import gpu_spec
    from rlinf_pipe.planning.profile import default_gpu
    from rlinf_pipe.planning.search import search
    from rlinf_pipe.planning.search_report import render_search, search_json

    args.overrides = [*args.overrides, *_cluster_overrides(args.gpus)]
    cfg = load_cli_config(args)
    costs = _planning_costs(args, cfg)
    capacity = (int(cfg.cluster.gpu_memory_gb * 1e9) if cfg.cluster.gpu_memory_gb is not None
                else int(gpu_spec(args.gpu or default_gpu(cfg)).memory_bytes))
    result = search(cfg, costs, capacity, top=args.top)
    print(json.dumps(search_json(result, costs), indent=2) if args.json else render_search(result, costs))
    return 0


def _plan_validate(args: argparse.Namespace) -> int:
    """`plan --validate RUN_DIR [--profile OTHER]`: the run's placement predicted beside its measurement."""
    from rlinf_pipe.planning.profile import read_run_config
    from rlinf_pipe.planning.search_report import render_validation
    from rlinf_pipe.planning.validate import validate_run
    from pathlib import Path

    if not args.profile and not args.costs:
        args.profile = [args.validate]  # (the run profiles itself)
    costs = _planning_costs(args, read_run_config(Path(args.validate)))
    validation = validate_run(args.validate, costs)
    print(json.dumps(validation.to_json(), indent=2) if args.json else render_validation(validation, costs))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rlinf_pipe.errors import ConfigError

    if args.validate:
        return _plan_validate(args)
    if args.search:
        return _plan_search(args)
    if args.profile or args.costs or args.gpus is not None:
        raise ConfigError("--profile, --costs and --gpus go with --search or --validate RUN_DIR")
    from rlinf_pipe.runner.preflight import preflight
    from rlinf_pipe.planning.memory import memory_report
    from rlinf_pipe.planning.plan_report import render_plan
    from rlinf_pipe.planning.stage_graph import stage_graph

    from rlinf_pipe.planning.micro_batch_budget import resolve_micro_batch_tokens

    loaded = load_cli_config(args)
    cfg = resolve_micro_batch_tokens(loaded)
    resolved = {"actor.micro_batch_tokens": cfg.actor.micro_batch_tokens} if cfg is not loaded else {}
    checked = preflight(cfg, files=False)
    if not args.no_files:
        try:
            checked = preflight(cfg)
        except RlinfPipeError as exc:  # (a check of the model, data or checkpoint files: the others passed above)
            raise ConfigError(f"{exc} (`rlinf-pipe plan --no-files` skips the checks of files, to plan from a machine "
                              "without them)") from None
    plan = checked.plan
    memory = memory_report(cfg, plan)
    weights = {"transport": plan.weight_transport, "why": plan.weight_transport_why,
               "receivers": list(plan.weight_receivers)}
    checks = {"passed": list(checked.passed), "skipped": list(checked.skipped)}
    graph = stage_graph(plan)
    if args.json:
        print(json.dumps({**plan.placement.to_json(), "warnings": list(plan.warnings), "memory": memory.to_json(),
                          "weight_sync": weights, "stages": graph.to_json(), "checks": checks, "resolved": resolved},
                         indent=2))
        return 0
    notes = [*(f"{key}: auto -> {value} (the largest the memory estimate fits)" for key, value in resolved.items()),
             "step (stage, component, reads -> writes):", *(f"  {line}" for line in graph.describe()),
             f"weight sync: {plan.weight_transport} to {', '.join(plan.weight_receivers)} "
             f"({plan.weight_transport_why})",
             f"checks passed: {', '.join(checked.passed)}"]
    if checked.skipped:
        notes.append(f"checks skipped (--no-files): {', '.join(checked.skipped)}")
    print(render_plan(plan.placement, memory, plan.warnings, notes))
    return 0


def _train(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)  # a config error shows before anything starts
    from rlinf_pipe.runner import run  # (light: the driver stack loads while Ray starts)
    from rlinf_pipe.utils.tracing import process_started

    run(cfg, launched_at=process_started())  # (the launch on the timeline counts the command's imports too)
    return 0


def _rehearse(args: argparse.Namespace) -> int:
    from rlinf_pipe.errors import ConfigError

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    cfg = load_cli_config(args)
    from rlinf_pipe.runner.rehearse import rehearse

    def load(extra: Sequence[str]) -> Any:
        return load_cli_config(argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *extra]}))

    print(rehearse(cfg, load, steps=args.steps, model=args.model, output_dir=args.output).report)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlinf_pipe.engines.offline_eval import evaluate_model
    from rlinf_pipe.errors import ConfigError

    for flag in ("limit", "k"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.dataset is not None:
        args.overrides.append(f"data.dataset={args.dataset}")
    cfg = load_cli_config(args)
    k = args.k or cfg.runner.val_k
    metrics = evaluate_model(cfg, args.model or cfg.actor.model_path, Path(args.out), args.limit or cfg.data.val_size,
                             k, heldout=args.heldout)
    print(f"{metrics['dataset']}: pass@1 {metrics['val/pass@1']:.3f}, pass@{k} {metrics['val/pass@k']:.3f} "
          f"over {metrics['val/problems']:.0f} problems ({metrics['model']}); wrote {args.out}/metrics.json and "
          f"{args.out}/problems.jsonl")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from rlinf_pipe.utils.timeline import timeline_report

    print(timeline_report(args.run_dir, render=not args.no_png))
    return 0


def _convert(args: argparse.Namespace) -> int:
    """`rlinf-pipe convert`: check the input, convert into a temporary sibling of OUT_DIR, then rename it."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from rlinf_pipe.models.convert import ConversionError, convert_hf_to_megatron, convert_megatron_to_hf
    from rlinf_pipe.models.weight_map import read_hf_arch
    from rlinf_pipe.models.megatron_checkpoint import read_megatron_meta
    from rlinf_pipe.models.arch import UnsupportedModelError, check_parallel_sizes

    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        kind = "Hugging Face model" if args.to == "megatron" else "Megatron checkpoint"
        raise ConversionError(f"SRC {src} does not exist or is not a folder; pass the {kind} folder to convert")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"OUT_DIR {out} already exists and is not empty; pass a new folder or remove it")
    if args.to == "megatron":
        if args.tp < 1 or args.pp < 1:
            raise ConversionError(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
        try:
            check_parallel_sizes(read_hf_arch(src), args.tp, args.pp)
        except UnsupportedModelError as exc:
            msg = str(exc).replace("tensor_parallel_size", "--tp").replace("pipeline_parallel_size", "--pp")
            raise ConversionError(f"cannot split {src}: {msg}") from exc
    else:
        if args.tp is not None or args.pp is not None:
            raise ConversionError("--tp/--pp only apply to --to megatron; --to hf reads them from megatron.json")
        read_hf_arch(read_megatron_meta(src).hf_dir)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if args.to == "megatron":
            convert_hf_to_megatron(src, tmp, tp=args.tp, pp=args.pp)
        else:
            convert_megatron_to_hf(src, tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}")
    return 0


def _convert_with_defaults(args: argparse.Namespace) -> int:
    if args.to == "megatron":
        args.tp = 1 if args.tp is None else args.tp
        args.pp = 1 if args.pp is None else args.pp
    return _convert(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlinf-pipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="validate a config and its placement (no Ray needed) and show which process owns each GPU"
    )
    _add_config_args(plan)
    plan.add_argument("--json", action="store_true",
                      help="print the placement and the per-GPU memory estimate as JSON")
    plan.add_argument("--no-files", action="store_true",
                      help="skip the checks that read the model, data and checkpoint files (plan a cluster from a "
                      "machine without them); every other check of `train` runs")
    plan.add_argument("--search", action="store_true", help="rank the placements and parallel sizes of the config's "
                      "cluster by predicted step time (docs/planning.md)")
    plan.add_argument("--validate", metavar="RUN_DIR", default=None, help="predict a run's own placement beside "
                      "its measured step time, bubble and tokens/s (profiled from itself unless --profile)")
    plan.add_argument("--profile", metavar="RUN_DIR", nargs="+", default=None, help="the costs a run measured (its "
                      "timeline.json and metrics.jsonl), or the median of several runs' (of one placement or "
                      "several: their co-run slowdown fitted together; a run at another tensor-parallel size gives "
                      "a TP all-reduce's hop); default: derived from the model's size and the GPU")
    plan.add_argument("--costs", metavar="ACTOR_S,ROLLOUT_S,INFERENCE_S", default=None, help="RLinf-style "
                      "seconds per step of each, measured collocated on every GPU")
    plan.add_argument("--gpus", type=int, default=None, help="search a cluster of N GPUs (nodes of 8) instead of "
                      "the config's")
    plan.add_argument("--gpu", choices=["H100", "H200", "A100", "cpu"], default=None, help="the GPU the default "
                      "costs assume (default: H100 for SGLang engines, else cpu: the virtual GPUs of this machine)")
    plan.add_argument("--top", type=int, default=5, help="candidates shown by --search (default 5)")
    plan.set_defaults(run=_plan)
    rehearse = commands.add_parser(
        "rehearse", help="train a cluster config for a few steps on this machine before booking the cluster: its "
        "nodes as local Ray nodes, its placement, parallel sizes, channels and weight routes, with the tiny model and "
        "the torch engine (docs/multi-node.md#rehearse-before-you-book)")
    _add_config_args(rehearse)
    rehearse.add_argument("--steps", type=int, default=2, help="steps to train (default 2)")
    rehearse.add_argument("--model", default=None, help="a model folder or built-in name to rehearse with instead "
                          "of the tiny model")
    rehearse.add_argument("--output", default="outputs/rehearsals", help="the rehearsal runs' folder")
    rehearse.set_defaults(run=_rehearse)
    train = commands.add_parser("train", help="run a config (the same as examples/math/main_math.py)")
    _add_config_args(train)
    train.set_defaults(run=_train)
    evaluate = commands.add_parser(
        "eval", help="evaluate a model on a dataset in this process: greedy pass@1 and sampled pass@k, per-problem "
        "responses (e.g. rlinf-pipe eval --model tiny --dataset arithmetic --limit 32 --out DIR)")
    _add_config_args(evaluate)
    evaluate.add_argument("--model", default=None, help="an HF folder, a built-in model name or a run's checkpoint "
                          "(checkpoints/step_N); default: the config's actor.model_path")
    evaluate.add_argument("--dataset", default=None, help="arithmetic, gsm8k or a file (default: data.dataset)")
    evaluate.add_argument("--heldout", action="store_true", help="the config's validation set (data.val_dataset, "
                          "data.val_size): the problems a run with this config validates on")
    evaluate.add_argument("--limit", type=int, default=None, help="problems evaluated: the first N (default: "
                          "data.val_size)")
    evaluate.add_argument("--k", type=int, default=None, help="samples per problem for pass@k (default: "
                          "runner.val_k)")
    evaluate.add_argument("--out", required=True, help="output folder (metrics.json, problems.jsonl)")
    evaluate.set_defaults(run=_eval)
    timeline = commands.add_parser(
        "timeline", help="per-stage busy fractions, bubble and scheduler overhead of a run; renders timeline.png"
    )
    timeline.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holding timeline.json)")
    timeline.add_argument("--no-png", action="store_true", help="do not (re)render timeline.png")
    timeline.set_defaults(run=_timeline)
    convert = commands.add_parser(
        "convert",
        help="convert a checkpoint: HF folder -> Megatron folder (--to megatron --tp N --pp M) or back (--to hf)",
        description="Convert a Llama/Qwen2 checkpoint between a Hugging Face folder and an rlinf_pipe Megatron "
        "checkpoint folder (megatron.json + model/tpXX_ppYYY.safetensors + hf/). Pure tensor slicing: no GPU "
        "or torch.distributed needed. Examples: `rlinf-pipe convert --to megatron --tp 2 --pp 1 HF_DIR OUT_DIR`, "
        "`rlinf-pipe convert --to hf MEGATRON_DIR OUT_DIR`.",
    )
    convert.add_argument("--to", required=True, choices=["megatron", "hf"], help="output format")
    convert.add_argument("--tp", type=int, default=None, help="tensor-parallel size (--to megatron; default 1)")
    convert.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (--to megatron; default 1)")
    convert.add_argument("src", metavar="SRC", help="HF model folder (--to megatron) or Megatron folder (--to hf)")
    convert.add_argument("out", metavar="OUT_DIR", help="output folder (must not exist or be empty)")
    convert.set_defaults(run=_convert_with_defaults)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rlinf-pipe` console script. User errors exit 2 with a message, no traceback."""
    args = build_parser().parse_args(argv)
    return exit_on_user_error(args.run, args)


if __name__ == "__main__":
    sys.exit(main())

"""`rlinf-pipe` command line: `plan` (validate config + placement, show the GPU grid)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from rlinf_pipe.errors import RlinfPipeError


def exit_on_user_error(fn: Callable[..., Any], *args: Any) -> int:
    """Run `fn(*args)`; a user error (bad config, placement, cluster) prints `error: ...` and returns 2."""
    try:
        result = fn(*args)
    except RlinfPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-path", default="examples/math/config", help="folder of YAML configs")
    parser.add_argument(
        "--config-name",
        default=None,
        help="config file name without .yaml (default: the embedded tiny CPU pipeline config)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotlist overrides, e.g. runner.max_steps=5")


def _plan(args: argparse.Namespace) -> int:
    from rlinf_pipe.config import load_config
    from rlinf_pipe.scheduler.placement import plan_placement
    from rlinf_pipe.scheduler.plan_report import render_plan

    cfg = load_config(args.config_path, args.config_name, args.overrides)
    placement = plan_placement(cfg)
    print(json.dumps(placement.to_json(), indent=2) if args.json else render_plan(placement))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlinf-pipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="validate a config and its placement (no Ray needed) and show which process owns each GPU"
    )
    _add_config_args(plan)
    plan.add_argument("--json", action="store_true", help="print the placement as JSON")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rlinf-pipe` console script. User errors exit 2 with a message, no traceback."""
    args = build_parser().parse_args(argv)
    return exit_on_user_error(args.run, args)


if __name__ == "__main__":
    sys.exit(main())

"""The structure issue's counts (issue 45), measured the same way each time: `python scripts/structure_counts.py`.

- conditional lines in rlinf_pipe/runner and rlinf_pipe/workers (`if` / `elif` / `while` statements and conditional
  expressions) whose line names the run's mode (collocated, shared or locked GPUs, who computes the log-probs), the
  rollout backend or the weight transport;
- `use_channels` anywhere in the package;
- `Any` in the driver's calls to workers: annotations of `Any` in the verbs (runtime/group_call.py,
  runtime/worker_group.py) and `Any` in runner/ lines that call a verb;
- modules over 400 lines.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlinf_pipe"
CONDITIONAL = re.compile(r"^\s*(if|elif|while)\b|\bif\b.*\belse\b")
SHAPE_WORDS = re.compile(r"collocat|\blocks\b|\bshared\b|\.shared\b|share_|shares_|in_turns|transport|backend|\.mode\b|"
                         r"sglang|device_locks|actor_logprobs|logprob_component|native|disaggreg|torch_engine|"
                         r"concurrent")
VERB_CALL = re.compile(r"\.(all|replicas|sharded|rank\(|some\(|leader\()")


def code_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` outside docstrings and comments (a rough cut: triple-quoted blocks skipped)."""
    out, in_doc = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        quotes = line.count('"""')
        if in_doc:
            in_doc = quotes % 2 == 0
            continue
        if line.strip().startswith('"""'):
            in_doc = quotes % 2 == 1
            continue
        out.append((number, line.split("#", 1)[0]))
    return out


def counts() -> dict[str, object]:
    branching = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for folder in ("runner", "workers") for path in sorted((PACKAGE / folder).glob("*.py"))
                 for n, line in code_lines(path) if CONDITIONAL.search(line) and SHAPE_WORDS.search(line)]
    use_channels = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "use_channels" in p.read_text()]
    any_verbs = [f"{p.relative_to(ROOT)}:{n}" for p in (PACKAGE / "runtime" / "group_call.py",
                                                         PACKAGE / "runtime" / "worker_group.py")
                 for n, line in code_lines(p) if re.search(r"\bAny\b", line) and "import" not in line]
    any_calls = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((PACKAGE / "runner").glob("*.py"))
                 for n, line in code_lines(p) if VERB_CALL.search(line) and re.search(r"\bAny\b", line)]
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    return {"conditional_lines_on_shape": len(branching), "use_channels": len(use_channels),
            "any_in_verbs": len(any_verbs), "any_in_driver_calls": len(any_calls), "modules_over_400": long,
            "conditional_lines": branching, "any_in_verbs_at": any_verbs}


if __name__ == "__main__":
    result = counts()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if isinstance(value, list):
                print(f"{key}:", *(f"  {v}" for v in value), sep="\n")
            else:
                print(f"{key}: {value}")

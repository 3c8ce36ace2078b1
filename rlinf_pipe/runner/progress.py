"""Console feedback: a progress bar (step, reward, accuracy, tokens/s, ETA) and the end-of-run summary."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rlinf_pipe.utils.launch_timeline import render_launch


class Progress:
    """A tqdm bar over the run's steps; disabled (silent) when `enabled` is False."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not enabled,
                        dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self.bar.set_postfix(
            reward=f"{metrics.get('reward/mean', math.nan):.3f}",
            acc=f"{metrics.get('reward/accuracy', math.nan):.2f}",
            tok_s=f"{metrics.get('throughput/tokens_per_s', math.nan):.0f}",
            refresh=False,
        )
        self.bar.update(1)

    def rewind(self, step: int) -> None:
        """Continue counting from `step` (after a restart went back to a checkpoint)."""
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    @staticmethod
    def render_summary(summary: dict[str, Any], run_dir: Path) -> str:
        """One screen: learning, speed, where the time went, and where the outputs are."""
        t = summary.get("timeline", {})
        lines = [
            "",
            f"run finished: {summary['steps']} steps, {summary['mean_step_s']:.2f} s/step, "
            f"{summary['tokens_per_s']:.0f} response tokens/s",
            f"  reward   {summary['reward_first']:.3f} (first quarter) -> {summary['reward_last']:.3f} (last quarter)",
            f"  accuracy {summary['accuracy_first']:.3f} -> {summary['accuracy_last']:.3f}",
        ]
        validation = summary.get("validation", [])
        if validation:
            first, last = validation[0], validation[-1]
            lines.append(f"  validation pass@1 {first['pass@1']:.3f} (step {first['step']}) -> {last['pass@1']:.3f} "
                         f"(step {last['step']}), pass@{last['k']:.0f} {first['pass@k']:.3f} -> {last['pass@k']:.3f}")
        restarts = [e for e in summary.get("events", []) if e.get("event") == "restart"]
        if restarts:
            lost = ", ".join(f"{e['worker']} {e['how']} in step {e['step']}" for e in restarts)
            lines.append(f"  restarts: {len(restarts)} ({lost}; {sum(e['seconds'] for e in restarts):.0f} s in all)")
        if summary.get("launch"):
            lines.append(f"  {render_launch(summary['launch'])}")
        if t:
            busy = ", ".join(f"{k} {v:.0%}" for k, v in sorted(t["stage_busy"].items(), key=lambda kv: -kv[1])[:6])
            lines.append(f"  stage busy: {busy}")
            lines.append(f"  device bubble {t['bubble_fraction']:.0%}, scheduler overhead "
                         f"{t['scheduler_overhead_fraction']:.1%}")
        lines += [
            f"  outputs: {run_dir}/ (metrics.jsonl, timeline.json, timeline.png, reward.png, checkpoints/)",
            f"  inspect: rlinf-pipe timeline {run_dir}",
        ]
        return "\n".join(lines)

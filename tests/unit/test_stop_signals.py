"""SIGINT / SIGTERM handling of a run (`rlinf_pipe.runner.stop`), with real signals sent to this process."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rlinf_pipe.cli import exit_on_user_error
from rlinf_pipe.errors import RunStopped
from rlinf_pipe.runner.stop import StepAbandoned, StopSignals


def _run(stop: StopSignals, signum: int | None, finish: str) -> str:
    """One step under `stop` that sends `signum` to this process, then finishes at once (`now`), once the stop is
    asked (`when_asked`) or `never`."""

    async def step() -> str:
        if signum is not None:
            os.kill(os.getpid(), signum)
        if finish == "when_asked":
            await stop.event.wait()
        elif finish == "never":
            await asyncio.Event().wait()
        return "done"

    async def main() -> str:
        stop.attach(asyncio.get_running_loop())
        try:
            return await stop.or_abandon(step())
        finally:
            stop.detach()

    return asyncio.run(main())


def test_a_step_without_a_signal_runs_to_its_end():
    with StopSignals(grace_s=0) as stop:
        assert _run(stop, None, "now") == "done"
        assert not stop.requested


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_first_signal_lets_the_step_finish_within_the_grace_and_asks_for_a_stop(signum):
    with StopSignals(grace_s=30) as stop:
        assert _run(stop, signum, "when_asked") == "done"
        assert stop.requested and stop.name == signal.Signals(signum).name


def test_a_step_that_outlasts_the_grace_is_abandoned():
    with StopSignals(grace_s=0) as stop:
        with pytest.raises(StepAbandoned, match="stop_grace_s=0"):
            _run(stop, signal.SIGTERM, "never")
        assert stop.requested


def test_outside_the_run_loop_and_for_a_second_signal_the_stop_is_immediate():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(grace_s=5):
        with pytest.raises(RunStopped, match="stopped at once by SIGTERM") as first:
            os.kill(os.getpid(), signal.SIGTERM)  # not attached to a loop: the job is still launching
        assert first.value.exit_code == 143
        with pytest.raises(RunStopped, match="a second signal") as second:
            os.kill(os.getpid(), signal.SIGINT)
        assert second.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handlers are back


def test_the_cli_exits_with_128_plus_the_signal_and_one_line(capsys):
    def stopped() -> None:
        raise RunStopped(signal.SIGTERM, "stopped by SIGTERM before step 3 of 10")

    assert exit_on_user_error(stopped) == 143
    assert capsys.readouterr().err == "rlinf-pipe: stopped by SIGTERM before step 3 of 10\n"

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert exit_on_user_error(interrupted) == 130

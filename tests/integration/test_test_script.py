"""`scripts/test.sh`, the README's and CI's test command: its two passes (tests two files at a time, then the
`alone` ones) and its exit status, which must not hide a failing test in either pass."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str) -> subprocess.CompletedProcess:
    """The script on `args` without its static checks (the same at every call; the test command runs them)."""
    return subprocess.run(["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "-c", "pyproject.toml",
                           "--rootdir", str(ROOT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "RLINF_PIPE_SKIP_STATIC_CHECKS": "1"})


@pytest.fixture
def tests_folder(tmp_path: Path) -> Path:
    (tmp_path / "test_side_by_side.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    (tmp_path / "test_alone.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.alone\n\ndef test_alone(request):\n    "
        "assert request.config.getoption('numprocesses', None) in (None, 0)  # (not under pytest-xdist)\n")
    return tmp_path


def test_each_pass_runs_its_tests_and_a_pass_with_none_counts_as_passed(tests_folder):
    both = run_script(str(tests_folder))
    assert both.returncode == 0, both.stdout[-3000:] + both.stderr[-3000:]
    assert "2 passed" in both.stdout and "1 passed, 2 deselected" in both.stdout
    only_one_kind = run_script(str(tests_folder / "test_side_by_side.py"))
    assert only_one_kind.returncode == 0 and "2 deselected" in only_one_kind.stdout


@pytest.mark.parametrize("failing", ["test_side_by_side.py", "test_alone.py"])
def test_a_failing_test_in_either_pass_fails_the_script(tests_folder, failing):
    file = tests_folder / failing
    file.write_text(file.read_text() + "\ndef test_fails():\n    assert 1 == 2\n")
    proc = run_script(str(tests_folder))
    assert proc.returncode == 1 and "1 failed" in proc.stdout


def test_a_selection_of_no_test_at_all_is_pytests_no_tests_status(tests_folder):
    assert run_script(str(tests_folder), "-k", "no_such_test").returncode == 5


def test_the_pins_pass_alone_needs_its_environment(tmp_path):
    """`--pins` runs only the pins pass, in .venv-pins (`bash scripts/setup.sh pins`): without it, it says so."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text((ROOT / "scripts" / "test.sh").read_text())
    proc = subprocess.run(["bash", "scripts/test.sh", "--pins"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 1 and "no .venv-pins here; make it with: bash scripts/setup.sh pins" in proc.stderr

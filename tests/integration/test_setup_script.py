"""`scripts/setup.sh sglang` refuses, before it creates or installs anything, a node where sglang 0.5.23 has no wheel
(Python outside 3.11-3.13, glibc older than 2.34), each in one line with the reason and the fix. Run on a copy of the
script in a folder of its own, with a fake Python and a fake `getconf` in front on PATH."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def setup(tmp_path: Path, python_version: str, glibc: str | None, extras: str = "sglang") -> subprocess.CompletedProcess:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tree / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = _executable(bin_dir / "python-fake", f"#!/bin/sh\necho {python_version}\n")
    if glibc is not None:
        _executable(bin_dir / "getconf", f"#!/bin/sh\necho glibc {glibc}\n")
    else:  # (musl: neither getconf nor ldd names a glibc)
        _executable(bin_dir / "getconf", "#!/bin/sh\nexit 1\n")
        _executable(bin_dir / "ldd", "#!/bin/sh\necho 'musl libc (x86_64)'\n")
    env = {**os.environ, "PYTHON": str(python), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(tree / "scripts" / "setup.sh"), extras], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("python_version", "glibc", "said"), [
    ("3.14", "2.39", "has wheels for Python 3.11 to 3.13 only, and {python} is Python 3.14"),
    ("3.10", "2.39", "Run with PYTHON=python3.12"),
    ("3.12", "2.31", "this node has glibc 2.31: pip would find no wheel"),
    ("3.12", "2.28", "glibc 2.34 or newer: Ubuntu 22.04, RHEL 9"),
    ("3.12", None, "this node has no glibc"),
])
def test_a_node_without_sglang_wheels_is_refused_before_anything_is_installed(tmp_path, python_version, glibc, said):
    proc = setup(tmp_path, python_version, glibc)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("[setup] error: sglang 0.5.23") and said.format(python=tmp_path / "bin" / "python-fake") in line
    assert not (tmp_path / "tree" / ".venv").exists()


@pytest.mark.parametrize("glibc", ["2.34", "2.35", "2.39"])
def test_a_node_with_wheels_passes_the_check(tmp_path, glibc):
    """(It goes on to create the environment, which the fake Python cannot: that is where it stops here.)"""
    proc = setup(tmp_path, "3.12", glibc)
    assert "[setup] error" not in proc.stderr and "[setup] creating .venv" in proc.stdout


def test_other_extras_are_not_checked(tmp_path):
    proc = setup(tmp_path, "3.14", "2.17", extras="test")
    assert "[setup] error" not in proc.stderr and "[setup] creating .venv" in proc.stdout

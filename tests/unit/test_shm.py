"""/dev/shm's size: the warning a GPU worker gives where it is small, and blocks that reserve their pages."""

from __future__ import annotations

import os

import pytest

from rlinf_pipe.scheduler import worker
from rlinf_pipe.utils.shm import SHM_FIX, reserved_block, shm_space, small_shm_warning


def test_a_small_shm_is_named_with_its_size_and_the_fix(tmp_path):
    total, free = shm_space(str(tmp_path))
    assert 0 <= free <= total
    said = small_shm_warning(str(tmp_path), least_bytes=total + 1)
    assert said.startswith(f"{tmp_path} on this node holds only {total / 2**20:.0f} MiB") and SHM_FIX in said
    assert "unhandled system error" in said
    assert small_shm_warning(str(tmp_path), least_bytes=total) == ""
    assert small_shm_warning(str(tmp_path / "missing")) == ""


def test_gpu_workers_warn_only_with_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(worker, "small_shm_warning", lambda: "/dev/shm on this node holds only 64 MiB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker.warn_small_shm("actor/0")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    worker.warn_small_shm("actor/0")
    assert capsys.readouterr().err == "[rlinf_pipe] actor/0: /dev/shm on this node holds only 64 MiB\n"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_reserved_block_has_its_pages_already():
    block = reserved_block(3 << 20)
    try:
        assert os.fstat(block._fd).st_blocks * 512 >= 3 << 20  # allocated, not a hole to fill on write
        block.buf[-1] = 7
    finally:
        block.close()
        block.unlink()

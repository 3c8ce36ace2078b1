"""What a worker says about its node at start-up: a /dev/shm too small for NCCL, GPUs that torch cannot use; and
shared-memory blocks that reserve their pages."""

from __future__ import annotations

import os

import pytest

from rlinf_pipe.runtime import worker
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


def test_a_worker_on_a_gpu_node_that_gets_no_cuda_from_torch_says_why(monkeypatch, capsys, tmp_path):
    import torch

    driver = tmp_path / "nvidiactl"
    monkeypatch.setattr(worker, "NVIDIA_DEVICE", str(driver))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker.warn_cpu_torch_on_gpus("actor/0")  # no driver on this node: virtual GPUs, nothing to say
    assert capsys.readouterr().err == ""
    driver.touch()
    monkeypatch.setattr(torch.version, "cuda", None)
    worker.warn_cpu_torch_on_gpus("actor/0")
    said = capsys.readouterr().err
    assert said.startswith(f"[rlinf_pipe] actor/0: this node has an NVIDIA driver but torch {torch.__version__} is "
                           "a CPU-only build") and "runs on the CPU" in said and "scripts/setup.sh" in said

    def too_old() -> None:
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12040).\nPlease update")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "init", too_old)
    worker.warn_cpu_torch_on_gpus("actor/0")
    assert "(CUDA 13.0) cannot use the GPUs: The NVIDIA driver on your system is too old (found version 12040)." \
           in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    worker.warn_cpu_torch_on_gpus("actor/0")
    assert capsys.readouterr().err == ""

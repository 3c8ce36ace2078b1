"""What is checked before an SGLang engine starts, each refusal one line with the fix: the node's NVIDIA driver
against the CUDA that torch and sglang were built for (the decision on fakes of the driver; the driver read through
libcuda or nvidia-smi), the flashinfer JIT cache shared by a node's engines, and room on the engine's first GPU for
the CUDA contexts of its other TP ranks when they map the buckets there (free memory faked)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from support import sglang_standin

from rlinf_pipe.engines.rollout import sglang_node, sglang_weights
from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine, SGLangError
from rlinf_pipe.engines.rollout.sglang_launch import GIB
from rlinf_pipe.planning.engine_sizes import PEER_CONTEXT_BYTES
from rlinf_pipe.models.tiny import ensure_tiny_model
from rlinf_pipe.models.weight_map import read_hf_arch
from rlinf_pipe.weights import plan_weight_layout

SGLANG = "0.5.23"


@pytest.mark.parametrize(("driver", "torch_built", "sglang_major", "expected"), [
    ((13, 0), (13, 0), 13, ""),
    ((13, 1), (13, 0), 13, ""),  # (a driver runs every minor version of its CUDA major)
    ((12, 8), (13, 0), 13, "supports CUDA 12.8, but torch 2.14.1+cu130 was built for CUDA 13.0 and sglang 0.5.23 "
                           "needs CUDA 13 (cuda-python>=13)"),
    ((12, 8), (12, 8), 13, "sglang 0.5.23 needs CUDA 13"),  # (torch's own build would run: sglang's kernels not)
    (None, (13, 0), 13, "no NVIDIA driver found on this node"),
    ((13, 0), None, 13, "is a CPU-only build"),
])
def test_the_driver_must_run_the_cuda_of_torch_and_of_sglang(driver, torch_built, sglang_major, expected):
    problem = sglang_node.cuda_driver_problem(driver, "2.14.1+cu130", torch_built, sglang_major, SGLANG)
    if not expected:
        assert problem == ""
        return
    assert expected in problem and "\n" not in problem
    if driver is not None and torch_built is not None:
        assert "install an NVIDIA driver of branch R580 or newer" in problem


def test_the_check_reads_the_installed_versions_and_refuses_before_the_engine_starts(monkeypatch):
    monkeypatch.setattr(sglang_node, "driver_cuda_version", lambda: (12, 4))
    monkeypatch.setattr(sglang_node, "torch_cuda", lambda: ("2.14.1+cu130", (13, 0)))
    monkeypatch.setattr(sglang_node, "sglang_cuda_major", lambda: None)  # (metadata naming none: 0.5.23's 13)
    with pytest.raises(sglang_node.NodeNotReadyError, match=r"CUDA 12\.4, but torch 2\.14\.1\+cu130 .* CUDA 13"):
        sglang_node.check_cuda_driver(SGLANG)
    monkeypatch.setattr(sglang_node, "driver_cuda_version", lambda: (13, 0))
    sglang_node.check_cuda_driver(SGLANG)


def test_sglangs_cuda_is_the_major_of_its_cuda_python_requirement():
    assert sglang_node.sglang_cuda_major(["torch==2.14.1", "cuda-python>=13.0", "flashinfer_python[cu13]==0.7.2"]) == 13
    assert sglang_node.sglang_cuda_major(["cuda_python >= 12.4; extra == 'x'"]) == 12
    assert sglang_node.sglang_cuda_major(["torch"]) is None


def _fake_nvidia_smi(folder: Path, says: str) -> None:
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   {says} |'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_the_driver_is_read_from_libcuda_else_nvidia_smi(tmp_path, monkeypatch):
    import ctypes

    real = ctypes.CDLL

    def no_libcuda(name, *args, **kwargs):
        if name == "libcuda.so.1":
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", no_libcuda)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _fake_nvidia_smi(tmp_path, "CUDA Version: 12.8")
    assert sglang_node.driver_cuda_version() == (12, 8)
    _fake_nvidia_smi(tmp_path, "no CUDA here")
    assert sglang_node.driver_cuda_version() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert sglang_node.driver_cuda_version() is None


def test_a_nodes_engines_share_one_local_jit_cache_unless_one_is_set(tmp_path, monkeypatch):
    """flashinfer 0.7.2 keeps its JIT cache under $FLASHINFER_WORKSPACE_BASE (else the home folder) and locks each
    kernel's build there: engines that share it compile a kernel once."""
    env: dict[str, str] = {}
    folder = tmp_path / "jit"
    assert sglang_node.use_node_jit_cache(env, folder) == str(folder) and folder.is_dir()
    assert sglang_node.jit_cache_of(env) == folder / ".cache" / "flashinfer"
    assert sglang_node.use_node_jit_cache(env, tmp_path / "other") == str(folder)  # (the second engine: the same)
    assert sglang_node.use_node_jit_cache({"FLASHINFER_WORKSPACE_BASE": "/scratch/me"}, folder) == "/scratch/me"
    (tmp_path / "file").write_text("")
    unwritable: dict[str, str] = {}  # (a folder that cannot be made: flashinfer keeps its default, said once)
    assert sglang_node.use_node_jit_cache(unwritable, tmp_path / "file" / "jit") == str(Path.home())
    assert unwritable == {}
    # an engine sets it before sglang (and flashinfer with it) is imported, so its schedulers inherit it
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    monkeypatch.setattr(sglang_node, "JIT_CACHE_DIR", folder)
    seen = {}

    class Recording:
        io_struct = sglang_standin.io_struct

        @staticmethod
        def Engine(**kwargs):
            seen["jit"] = os.environ.get("FLASHINFER_WORKSPACE_BASE")
            return sglang_standin.Engine(**kwargs)

    model = ensure_tiny_model(tmp_path / "models", arch="qwen2")
    engine = SGLangEngine(model, dtype="float32", sglang=Recording)
    engine.shutdown()
    assert seen["jit"] == str(folder)


@pytest.mark.parametrize(("tp", "transport", "free_gib", "refused"), [
    (1, "object_store", 0.1, False), (4, "broadcast", 0.1, False), (4, "object_store", 8.0, False),
    (4, "object_store", 1.0, True), (8, "ipc", 3.0, True),
])
def test_room_for_the_contexts_of_the_other_tp_ranks_on_the_first_gpu(tp, transport, free_gib, refused):
    problem = sglang_weights.peer_context_error(tp, transport, 64 << 20, int(free_gib * GIB))
    assert bool(problem) == refused
    if refused:
        need = (tp - 1) * PEER_CONTEXT_BYTES + (64 << 20)
        assert f"{tp - 1} other TP ranks" in problem and f"{need / GIB:.2f} GiB" in problem
        assert "use runner.weight_sync=broadcast" in problem and "lower rollout.gpu_memory_fraction" in problem


async def test_the_engine_refuses_a_transport_its_first_gpu_has_no_room_for(tmp_path, monkeypatch):
    model = ensure_tiny_model(tmp_path / "models", arch="qwen2")
    engine = SGLangEngine(model, dtype="float32", tp_size=2, sglang=sglang_standin)
    layout = plan_weight_layout(read_hf_arch(str(model)), torch.float32, 1 << 20)
    monkeypatch.setattr(sglang_weights, "free_gpu_bytes", lambda: 100 << 20)  # (what CUDA would say is free)
    try:
        with pytest.raises(SGLangError, match="runner.weight_sync=object_store: its 1 other TP ranks"):
            await engine.open_weight_receiver("object_store", layout, None, 0)
        monkeypatch.setattr(sglang_weights, "free_gpu_bytes", lambda: 8 * GIB)
        assert await engine.open_weight_receiver("object_store", layout, None, 0) is None
    finally:
        engine.shutdown()

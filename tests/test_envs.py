"""pagedjax.envs: every PAGEDJAX_* variable, parsed when read."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedjax import envs


def test_flags_parse_and_default(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDJAX_FREEZE_GC_HEAP", raising=False)
    assert envs.PAGEDJAX_FREEZE_GC_HEAP is True
    for off in ("0", "false", "False", "no"):
        monkeypatch.setenv("PAGEDJAX_FREEZE_GC_HEAP", off)
        assert envs.PAGEDJAX_FREEZE_GC_HEAP is False
    monkeypatch.setenv("PAGEDJAX_DISABLE_COMPILE_CACHE", "1")
    assert envs.PAGEDJAX_DISABLE_COMPILE_CACHE is True


def test_the_engine_core_process_is_unset_unless_said(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDJAX_ENGINE_CORE_PROCESS", raising=False)
    assert envs.PAGEDJAX_ENGINE_CORE_PROCESS is None  # each caller's own default
    monkeypatch.setenv("PAGEDJAX_ENGINE_CORE_PROCESS", "0")
    assert envs.PAGEDJAX_ENGINE_CORE_PROCESS is False


def test_the_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    assert envs.PAGEDJAX_CACHE_DIR == tmp_path
    monkeypatch.delenv("PAGEDJAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.PAGEDJAX_CACHE_DIR == Path(tmp_path / "xdg" / "pagedjax")


def test_an_unknown_name_is_an_error() -> None:
    with pytest.raises(AttributeError, match="PAGEDJAX_NOPE"):
        envs.PAGEDJAX_NOPE  # noqa: B018
    assert "PAGEDJAX_COMPILE_AT_STARTUP" in dir(envs)

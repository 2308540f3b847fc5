"""vllm_br.entry_points.platform_class_path: when the SUPA platform activates.

vLLM calls it at least twice per process and treats an exception as "plugin
inactive": it must be cached, idempotent and never raise."""

from __future__ import annotations

import logging

import pytest

from vllm_br import device as device_layer
from vllm_br import entry_points

PATH = "vllm_br.platform.SUPAPlatform"


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _fresh_decision(monkeypatch):
    monkeypatch.delenv("VLLM_BR_DEVICE", raising=False)
    entry_points.reset_for_tests()
    yield
    # Leave the decision to be made again under the session's environment.
    entry_points.reset_for_tests()


@pytest.fixture
def log():
    logger = logging.getLogger("vllm.vllm_br.entry_points")
    handler = _ListHandler()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _lines(records: list[logging.LogRecord]) -> list[str]:
    # One line per decision, whatever its level (the active case may log at
    # DEBUG and have the platform repeat it once logging is configured).
    return [r.getMessage() for r in records]


def _reason() -> str | None:
    fn = getattr(entry_points, "activation_reason", None)
    return fn() if fn is not None else None


def _no_supa_device(monkeypatch):
    monkeypatch.setattr(device_layer, "supa_present", lambda: False)


@pytest.mark.parametrize("choice", ["cpu", "supa"])
def test_explicit_device_activates(monkeypatch, choice):
    monkeypatch.setenv("VLLM_BR_DEVICE", choice)
    # An explicit choice wins over whatever else is installed here.
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: "cuda")
    assert entry_points.platform_class_path() == PATH


def test_decision_is_cached_and_idempotent(monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    calls = []
    real = entry_points._decide

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(entry_points, "_decide", counting)
    first = entry_points.platform_class_path()
    second = entry_points.platform_class_path()
    assert first == second == PATH
    assert len(calls) == 1
    # Cached: a later environment change does not flip the decision ...
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: "cuda")
    _no_supa_device(monkeypatch)
    assert entry_points.platform_class_path() == PATH
    assert len(calls) == 1
    # ... until reset.
    entry_points.reset_for_tests()
    assert entry_points.platform_class_path() is None
    assert len(calls) == 2


def test_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("detection exploded")

    monkeypatch.setattr(entry_points, "_decide", boom)
    assert entry_points.platform_class_path() is None
    assert entry_points.platform_class_path() is None


def test_auto_no_device_no_other_platform_activates(monkeypatch, log):
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    _no_supa_device(monkeypatch)
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: None)
    assert entry_points.platform_class_path() == PATH
    infos = _lines(log)
    assert len(infos) == 1, infos
    assert "active" in infos[0] and "cpu" in infos[0]
    assert _reason() in (None, infos[0])


def test_unset_device_is_auto(monkeypatch):
    _no_supa_device(monkeypatch)
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: None)
    assert entry_points.platform_class_path() == PATH


def test_auto_no_device_other_platform_inactive(monkeypatch, log):
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    _no_supa_device(monkeypatch)
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: "cuda")
    assert entry_points.platform_class_path() is None
    infos = _lines(log)
    assert len(infos) == 1, infos
    assert "inactive" in infos[0] and "cuda" in infos[0]
    assert "VLLM_BR_DEVICE=cpu" in infos[0]


def test_auto_supa_present_activates(monkeypatch, log):
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    monkeypatch.setattr(device_layer, "supa_present", lambda: True)
    # A SUPA card wins even where another vLLM platform would also serve.
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: "cuda")
    assert entry_points.platform_class_path() == PATH
    infos = _lines(log)
    assert len(infos) == 1, infos
    assert "SUPA device" in infos[0]
    assert _reason() in (None, infos[0])


def test_invalid_device_still_activates(monkeypatch, log):
    # Active anyway, so the platform stops start-up with the one sentence
    # instead of vLLM silently using another platform.
    monkeypatch.setenv("VLLM_BR_DEVICE", "gpu")
    monkeypatch.setattr(entry_points, "_other_vllm_platform", lambda: "cuda")
    assert entry_points.platform_class_path() == PATH
    errors = [r.getMessage() for r in log if r.levelno == logging.ERROR]
    assert errors and "VLLM_BR_DEVICE" in errors[0]


def test_entry_point_returns_the_same():
    import vllm_br

    assert vllm_br.register() == entry_points.platform_class_path()

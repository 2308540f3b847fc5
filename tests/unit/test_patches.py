"""The patch ledger, the CLI error sentence, and the cpu torch.accelerator shim."""

from __future__ import annotations

import pytest
import torch

from vllm_br import patches
from vllm_br.device import cpu_accelerator
from vllm_br.device.cpu import CpuBackend
from vllm_br.errors import SUPAConfigError

SENTENCE = "--block-size 16 is not supported on SUPA; use --block-size 128."


# ---- ledger -----------------------------------------------------------------
def test_ledger_entries_are_documented():
    assert patches.LEDGER
    names = [p.name for p in patches.LEDGER]
    assert len(names) == len(set(names)), names
    for p in patches.LEDGER:
        for field in ("name", "target", "why", "remove_when", "scope"):
            value = getattr(p, field)
            assert isinstance(value, str) and value.strip(), (p.name, field)


def test_every_applied_patch_is_in_the_ledger():
    names = {p.name for p in patches.LEDGER}
    assert set(patches._APPLY) <= names, set(patches._APPLY) - names


# ---- user_error_sentence ------------------------------------------------------
def test_sentence_of_a_supa_error():
    assert patches.user_error_sentence(SUPAConfigError(SENTENCE)) == SENTENCE


def test_sentence_found_through_cause_and_context():
    try:
        try:
            raise SUPAConfigError(SENTENCE)
        except SUPAConfigError as e:
            raise RuntimeError("engine start-up failed") from e
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == SENTENCE
        wrapped = outer

    try:
        try:
            raise wrapped
        except RuntimeError:
            raise KeyError("while handling")  # noqa: B904 (implicit __context__)
    except KeyError as outer:
        assert outer.__cause__ is None
        assert patches.user_error_sentence(outer) == SENTENCE


def test_sentence_found_inside_pydantic_validation_error():
    pydantic = pytest.importorskip("pydantic")

    class Settings(pydantic.BaseModel):
        block_size: int

        @pydantic.field_validator("block_size")
        @classmethod
        def _supa(cls, v: int) -> int:
            if v != 128:
                raise SUPAConfigError(SENTENCE)
            return v

    with pytest.raises(pydantic.ValidationError) as info:
        Settings(block_size=16)
    assert not isinstance(info.value, SUPAConfigError)
    assert patches.user_error_sentence(info.value) == SENTENCE

    # ... and a ValidationError chained inside another exception.
    try:
        raise RuntimeError("config failed") from info.value
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == SENTENCE


def test_sentence_from_vllm_config_validation_error(tiny_llama_dir, monkeypatch):
    # The real thing: VllmConfig (a pydantic dataclass) wraps the platform's
    # SUPAConfigError in a ValidationError.
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(Exception) as info:  # noqa: B017
        EngineArgs(model=str(tiny_llama_dir), block_size=16).create_engine_config()
    assert not isinstance(info.value, SUPAConfigError)
    sentence = patches.user_error_sentence(info.value)
    assert sentence is not None and "--block-size 16" in sentence
    assert "\n" not in sentence


def test_unknown_architecture_becomes_one_sentence():
    supported = ", ".join(f"Arch{i}ForCausalLM" for i in range(400))
    err = ValueError(
        "Model architectures ['FooBarForCausalLM'] are not supported for now. "
        f"Supported architectures: dict_keys([{supported}])"
    )
    sentence = patches.user_error_sentence(err)
    assert sentence is not None
    assert "FooBarForCausalLM" in sentence
    assert "Arch1ForCausalLM" not in sentence
    assert "\n" not in sentence and sentence.endswith(".")
    assert len(sentence) < 300
    # Also when vLLM's error is wrapped.
    try:
        raise RuntimeError("model config failed") from err
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == sentence


def test_unrelated_error_has_no_sentence():
    assert patches.user_error_sentence(RuntimeError("boom")) is None
    assert patches.user_error_sentence(ValueError("bad value")) is None
    try:
        raise KeyError("x") from RuntimeError("y")
    except KeyError as e:
        assert patches.user_error_sentence(e) is None


def test_sentence_survives_a_reference_cycle():
    a = RuntimeError("a")
    b = RuntimeError("b")
    a.__context__ = b
    b.__context__ = a
    assert patches.user_error_sentence(a) is None


# ---- cpu torch.accelerator shim ----------------------------------------------
@pytest.fixture
def pristine_accelerator():
    """torch.accelerator without the shim, whatever state the session is in
    (the general plugin may have installed it already); put back afterwards."""
    acc = torch.accelerator
    was_installed = bool(cpu_accelerator._originals)
    current = {n: getattr(acc, n, None) for n in cpu_accelerator._NAMES}
    saved_originals = dict(cpu_accelerator._originals)
    cpu_accelerator.uninstall()
    try:
        yield {n: getattr(acc, n, None) for n in cpu_accelerator._NAMES}
    finally:
        cpu_accelerator.uninstall()
        if was_installed:
            cpu_accelerator._originals.update(saved_originals)
            for name, fn in current.items():
                setattr(acc, name, fn)


def test_cpu_accelerator_shim_install_and_uninstall(pristine_accelerator):
    originals = pristine_accelerator
    acc = torch.accelerator
    if not acc.is_available():
        # What vLLM would hit on the cpu backend without the shim.
        with pytest.raises(RuntimeError, match="accelerator"):
            acc.synchronize()

    backend = CpuBackend()
    cpu_accelerator.install(backend)
    cpu_accelerator.install(backend)  # idempotent
    acc.synchronize()
    acc.synchronize(0)
    acc.empty_cache()
    assert acc.current_device_index() == backend.current_device()
    free, total = acc.get_memory_info()
    assert 0 <= free <= total and total > 0
    assert acc.get_memory_info(0)[1] == total
    with acc.device_index(0):
        pass
    assert acc.memory_allocated() > 0
    assert acc.max_memory_allocated() >= 0
    assert "allocated_bytes.all.current" in acc.memory_stats()
    acc.reset_peak_memory_stats()
    assert acc.current_stream() == backend.current_stream()

    cpu_accelerator.uninstall()
    for name in cpu_accelerator._NAMES:
        assert getattr(acc, name, None) is originals[name], name
    assert not cpu_accelerator._originals


def test_cpu_accelerator_patch_installs_the_shim_on_cpu(
    pristine_accelerator, monkeypatch
):
    # The ledger's "cpu-torch-accelerator" patch installs the shim on cpu.
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    patches._APPLY["cpu-torch-accelerator"]()
    assert cpu_accelerator._originals
    torch.accelerator.synchronize()

"""vllm_br.device.cpu_isa: what the cpu backend may use, capped by
ONEDNN_MAX_CPU_ISA (how the suite runs as on an AVX2-only host here)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from vllm_br.device import cpu_isa
from vllm_br.device.cpu_isa import HostISA


@pytest.fixture
def host(monkeypatch):
    """Pretend the CPU has ``features`` (a subset of avx512, avx512_bf16,
    amx, vnni); host_isa() is read afresh."""

    def set_features(*features: str) -> None:
        monkeypatch.setattr(
            torch.cpu, "_is_avx512_supported", lambda: "avx512" in features
        )
        monkeypatch.setattr(
            torch.cpu, "_is_avx512_bf16_supported", lambda: "avx512_bf16" in features
        )
        monkeypatch.setattr(
            torch.cpu, "_is_amx_tile_supported", lambda: "amx" in features
        )
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: "vnni" in features)
        cpu_isa.host_isa.cache_clear()

    yield set_features
    cpu_isa.host_isa.cache_clear()


ALL = HostISA(avx512=True, avx512_bf16=True, amx_bf16=True, avx512_vnni=True)
VNNI = HostISA(True, False, False, avx512_vnni=True)


@pytest.mark.parametrize(
    ("cap", "expect"),
    [
        (None, ALL),
        ("ALL", ALL),
        ("DEFAULT", ALL),
        ("AVX512_CORE_AMX", ALL),
        ("avx10_1_512_amx", ALL),  # oneDNN reads it in any case
        ("AVX512_CORE_FP16", HostISA(True, True, False, avx512_vnni=True)),
        ("AVX512_CORE_BF16", HostISA(True, True, False, avx512_vnni=True)),
        ("AVX512_CORE_VNNI", VNNI),
        ("AVX512_CORE", HostISA(True, False, False)),
        ("AVX2_VNNI_2", HostISA(False, False, False)),
        ("AVX2", HostISA(False, False, False)),
        ("SSE41", HostISA(False, False, False)),
    ],
)
def test_cap_on_a_host_with_everything(host, monkeypatch, cap, expect):
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    host("avx512", "avx512_bf16", "amx", "vnni")
    assert cpu_isa.host_isa() == expect
    assert cpu_isa.host_isa().fast_bf16 == (expect.avx512_bf16 or expect.amx_bf16)


def test_cap_adds_nothing_the_cpu_lacks(host, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    host()  # an AVX2-only CPU
    assert cpu_isa.host_isa() == HostISA(False, False, False)
    host("avx512")
    assert cpu_isa.host_isa() == HostISA(True, False, False)
    host("vnni")  # VNNI is the AVX-512 one: nothing without AVX-512
    assert cpu_isa.host_isa() == HostISA(False, False, False)


def test_unknown_cap_caps_nothing_and_says_so(host, monkeypatch, caplog):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX99_FUTURE")
    host("avx512", "avx512_bf16", "amx", "vnni")
    assert cpu_isa.host_isa() == ALL
    assert "ONEDNN_MAX_CPU_ISA=AVX99_FUTURE" in caplog.text


def _macros(flags: tuple[str, ...]) -> set[str]:
    """The ISA macros g++ defines for -march=native plus ``flags``."""
    out = subprocess.run(
        ["g++", "-march=native", *flags, "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        line.split()[1]
        for line in out.splitlines()
        if line.startswith("#define __AVX512") or line.startswith("#define __AMX")
    }


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (CI has it)")
@pytest.mark.parametrize(
    "isa",
    [
        HostISA(False, False, False),
        HostISA(True, False, False),
        HostISA(True, True, False),
        ALL,
    ],
)
def test_compiler_flags_drop_what_the_kernels_test(isa):
    """The macros the C++ kernels branch on (gemv: __AVX512BF16__; attention:
    __AMX_TILE__ / __AMX_BF16__) are gone where the ISA leaves them out;
    what the host has and the ISA keeps stays."""
    macros = _macros(isa.compiler_flags())
    native = _macros(())
    if not isa.avx512:
        assert not {m for m in macros if m.startswith("__AVX512")}
    if not isa.avx512_bf16:
        assert "__AVX512BF16__" not in macros
    if not isa.amx_bf16:
        assert not {"__AMX_TILE__", "__AMX_BF16__"} & macros
    if isa == ALL:
        assert macros == native

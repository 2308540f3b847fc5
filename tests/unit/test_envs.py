"""vllm_br.envs: defaults, parsing and one-sentence errors."""

from __future__ import annotations

import re

import pytest

from vllm_br import envs
from vllm_br.errors import SUPAConfigError

DEFAULTS = {
    "VLLM_BR_DEVICE": "auto",
    "SUPA_VISIBLE_DEVICES": None,
    "VLLM_BR_WEIGHT_TYPE": "NUMA",
    "VLLM_BR_QUANT_METHOD": "INT8",
    "VLLM_BR_USE_FUSED_ALLREDUCE": None,
    "VLLM_BR_USE_FP32_ALL_REDUCE": False,
    "VLLM_BR_USE_CPU_ALL_REDUCE": False,
    "VLLM_BR_DEVICE_SPC_NUM": None,
    "VLLM_BR_STATIC_MOE_DECODER_MAX_LEN": 256,
    "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE": False,
    "VLLM_BR_SUPERNODE_ID": None,
    "VLLM_SCCL_SO_PATH": envs.DEFAULT_SCCL_SO_PATH,
    "VLLM_BR_CPU_NUM_DEVICES": 8,
    "VLLM_BR_CPU_MEMORY_GIB": 4.0,
    "VLLM_BR_MODEL_CACHE": None,
    "VLLM_BR_CPU_KERNELS": True,
    "VLLM_BR_KERNEL_CACHE": "~/.cache/vllm-br/kernels",
    "VLLM_BR_CPU_BF16_MATMUL": "auto",
    "VLLM_BR_CPU_PACKED_GEMM": True,
    "VLLM_BR_CPU_ATTENTION_AMX": True,
}

BOOLS = [
    "VLLM_BR_USE_FP32_ALL_REDUCE",
    "VLLM_BR_USE_CPU_ALL_REDUCE",
    "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE",
]

# (variable, bad value, text the message must name as accepted)
BAD_VALUES = [
    ("VLLM_BR_DEVICE", "gpu", "auto | supa | cpu"),
    ("VLLM_BR_WEIGHT_TYPE", "ROW", "NUMA | UMA"),
    ("VLLM_BR_QUANT_METHOD", "FP8", "INT8"),
    ("VLLM_BR_USE_FUSED_ALLREDUCE", "many", "an integer >= 0"),
    ("VLLM_BR_USE_FUSED_ALLREDUCE", "-1", "an integer >= 0"),
    ("VLLM_BR_DEVICE_SPC_NUM", "0", "an integer >= 1"),
    ("VLLM_BR_DEVICE_SPC_NUM", "1.5", "an integer >= 1"),
    ("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", "x", "an integer >= 1"),
    ("VLLM_BR_CPU_NUM_DEVICES", "0", "an integer >= 1"),
    ("VLLM_BR_CPU_MEMORY_GIB", "lots", "a number > 0"),
    ("VLLM_BR_CPU_KERNELS", "maybe", "0 or 1"),
    ("VLLM_BR_CPU_BF16_MATMUL", "bf16", "auto | native | fp32"),
    ("VLLM_BR_CPU_PACKED_GEMM", "maybe", "0 or 1"),
    ("VLLM_BR_CPU_ATTENTION_AMX", "maybe", "0 or 1"),
    ("VLLM_BR_CPU_MEMORY_GIB", "0", "a number > 0"),
    ("VLLM_BR_CPU_MEMORY_GIB", "-2", "a number > 0"),
    ("VLLM_BR_CPU_MEMORY_GIB", "inf", "a number > 0"),
    ("VLLM_BR_CPU_MEMORY_GIB", "nan", "a number > 0"),
    ("SUPA_VISIBLE_DEVICES", "a,b", "comma-separated device indices"),
    ("SUPA_VISIBLE_DEVICES", "0,0", "comma-separated device indices"),
    ("SUPA_VISIBLE_DEVICES", "-1", "comma-separated device indices"),
] + [(name, "maybe", "0 or 1") for name in BOOLS]

# One sentence: ends with '.', and no '.' inside is followed by a space (a
# sentence break); dots inside numbers such as "0.0" or "1.5" are allowed.
ONE_SENTENCE = re.compile(r"^[^\n]*[^.\s]\.$")


def is_one_sentence(msg: str) -> bool:
    return bool(ONE_SENTENCE.match(msg)) and not re.search(r"\.\s", msg)


@pytest.fixture(autouse=True)
def _unset_all(monkeypatch):
    for name in envs.names():
        monkeypatch.delenv(name, raising=False)


def test_defaults_cover_every_variable():
    assert set(DEFAULTS) == set(envs.names())


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_default_when_unset(name):
    assert getattr(envs, name) == DEFAULTS[name]
    assert envs.describe(name).default == DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_empty_value_means_default(name, monkeypatch):
    monkeypatch.setenv(name, "  ")
    assert getattr(envs, name) == DEFAULTS[name]


def test_every_variable_is_documented():
    for name in envs.names():
        var = envs.describe(name)
        assert var.name == name and var.doc and var.accepted


@pytest.mark.parametrize(("name", "raw", "accepted"), BAD_VALUES)
def test_bad_value_raises_one_sentence(name, raw, accepted, monkeypatch):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SUPAConfigError) as info:
        getattr(envs, name)
    msg = str(info.value)
    assert msg.startswith(f"{name}=")
    assert repr(raw) in msg
    assert accepted in msg
    assert is_one_sentence(msg), msg
    # validate_all() reports the same error
    with pytest.raises(SUPAConfigError, match=re.escape(name)):
        envs.validate_all()


def test_one_sentence_checker():
    assert is_one_sentence("X='1.5' is not valid; accepted values: a number > 0.0.")
    assert not is_one_sentence("First sentence. Second sentence.")
    assert not is_one_sentence("no full stop")


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("0", False),
        ("true", True),
        ("false", False),
        ("TRUE", True),
        ("False", False),
    ],
)
def test_bools(name, raw, value, monkeypatch):
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) is value


def test_choices_are_case_insensitive(monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "CPU")
    assert envs.VLLM_BR_DEVICE == "cpu"
    monkeypatch.setenv("VLLM_BR_WEIGHT_TYPE", "uma")
    assert envs.VLLM_BR_WEIGHT_TYPE == "UMA"


def test_typed_values(monkeypatch):
    monkeypatch.setenv("VLLM_BR_USE_FUSED_ALLREDUCE", "0")
    assert envs.VLLM_BR_USE_FUSED_ALLREDUCE == 0
    monkeypatch.setenv("VLLM_BR_DEVICE_SPC_NUM", "16")
    assert envs.VLLM_BR_DEVICE_SPC_NUM == 16
    monkeypatch.setenv("VLLM_BR_CPU_MEMORY_GIB", "0.5")
    assert envs.VLLM_BR_CPU_MEMORY_GIB == 0.5
    monkeypatch.setenv("VLLM_SCCL_SO_PATH", "/opt/succl/libsuccl.so")
    assert envs.VLLM_SCCL_SO_PATH == "/opt/succl/libsuccl.so"


def test_supa_visible_devices(monkeypatch):
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "0,1")
    assert envs.SUPA_VISIBLE_DEVICES == [0, 1]
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "3, 1")
    assert envs.SUPA_VISIBLE_DEVICES == [3, 1]
    for bad in ("a,b", "0,0"):
        monkeypatch.setenv("SUPA_VISIBLE_DEVICES", bad)
        with pytest.raises(SUPAConfigError, match=r"^SUPA_VISIBLE_DEVICES="):
            envs.SUPA_VISIBLE_DEVICES  # noqa: B018


def test_values_are_read_late(monkeypatch):
    assert envs.VLLM_BR_CPU_NUM_DEVICES == 8
    monkeypatch.setenv("VLLM_BR_CPU_NUM_DEVICES", "2")
    assert envs.VLLM_BR_CPU_NUM_DEVICES == 2


def test_validate_all_returns_all_names(monkeypatch):
    values = envs.validate_all()
    assert list(values) == envs.names()
    assert values == DEFAULTS
    monkeypatch.setenv("VLLM_BR_DEVICE", "supa")
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "1")
    values = envs.validate_all()
    assert values["VLLM_BR_DEVICE"] == "supa"
    assert values["SUPA_VISIBLE_DEVICES"] == [1]


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        envs.VLLM_BR_NOT_A_VARIABLE  # noqa: B018
    assert "VLLM_BR_DEVICE" in dir(envs)

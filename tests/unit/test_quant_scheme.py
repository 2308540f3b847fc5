"""vllm_br.quantization.scheme: which checkpoints SUPA serves, what
VLLM_BR_QUANT_METHOD does with them, and the one-sentence errors a user sees.

Checkpoint configs are written inline, shaped like the ``quantization_config``
of real compressed-tensors and GPTQ checkpoints; model configs are stand-ins
with only the attributes the scheme reads. ``vllm_br.envs`` reads variables
when used (no cache), so monkeypatch.setenv takes effect at once.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from vllm_br import envs
from vllm_br.errors import SUPAConfigError
from vllm_br.quantization import scheme

CT = "compressed-tensors"


def ct_config(weights: dict, inputs: dict | None) -> dict:
    return {
        "quant_method": CT,
        "format": "int-quantized" if inputs else "pack-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
            }
        },
    }


def weights(bits: int, type_: str = "int", strategy: str = "channel") -> dict:
    return {
        "num_bits": bits,
        "type": type_,
        "symmetric": True,
        "strategy": strategy,
        "group_size": 128 if strategy == "group" else None,
        "dynamic": False,
    }


def acts(bits: int, type_: str = "int") -> dict:
    return {
        "num_bits": bits,
        "type": type_,
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }


W8A8_INT8 = ct_config(weights(8), acts(8))
W8A16 = ct_config(weights(8), None)
W4A16 = ct_config(weights(4, strategy="group"), None)
W8A8_FP8 = ct_config(weights(8, "float"), acts(8, "float"))
W4A8_INT = ct_config(weights(4, strategy="group"), acts(8))
GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}

# One sentence: ends with '.', no sentence break ('. ') and no newline inside.
ONE_SENTENCE = re.compile(r"^[^\n]*[^.\s]\.$")


def assert_one_sentence(err: BaseException) -> str:
    msg = str(err)
    assert ONE_SENTENCE.match(msg) and ". " not in msg, msg
    return msg


def model_config(method: str | None, quant_cfg: dict | None) -> SimpleNamespace:
    return SimpleNamespace(
        quantization=method, hf_config=SimpleNamespace(quantization_config=quant_cfg)
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in envs.names():
        monkeypatch.delenv(name, raising=False)


# ---- checkpoint_weight_bits ----------------------------------------------


def test_unquantized_checkpoint():
    assert scheme.checkpoint_weight_bits(None, None) is None


@pytest.mark.parametrize(
    "cfg,name,bits",
    [(W8A8_INT8, "W8A8-INT8", 8), (W8A16, "W8A16", 8), (W4A16, "W4A16", 4)],
)
def test_served_compressed_tensors_schemes(cfg, name, bits):
    assert scheme.checkpoint_weight_bits(CT, cfg) == (f"{CT} {name}", bits)


@pytest.mark.parametrize("cfg,name", [(W8A8_FP8, "W8A8-FP"), (W4A8_INT, "W4A8-INT")])
def test_unserved_compressed_tensors_schemes(cfg, name):
    with pytest.raises(SUPAConfigError) as err:
        scheme.checkpoint_weight_bits(CT, cfg)
    msg = assert_one_sentence(err.value)
    assert name in msg and "not served on SUPA" in msg
    assert "W8A8-INT8" in msg and "W4A16" in msg and "GPTQ" in msg  # what is served


def test_compressed_tensors_without_groups_raises():
    with pytest.raises(SUPAConfigError) as err:
        scheme.checkpoint_weight_bits(CT, {"quant_method": CT, "config_groups": {}})
    assert "config_groups" in assert_one_sentence(err.value)


@pytest.mark.parametrize("method", ["gptq", "auto_gptq"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_symmetric_is_served(method, bits):
    cfg = {**GPTQ4, "bits": bits}
    assert scheme.checkpoint_weight_bits(method, cfg) == (f"GPTQ int{bits}", bits)


@pytest.mark.parametrize(
    "cfg,words",
    [({**GPTQ4, "bits": 3}, "GPTQ int3"), ({**GPTQ4, "sym": False}, "sym=False")],
)
def test_gptq_unserved(cfg, words):
    with pytest.raises(SUPAConfigError) as err:
        scheme.checkpoint_weight_bits("gptq", cfg)
    msg = assert_one_sentence(err.value)
    assert words in msg and "does not serve" in msg


@pytest.mark.parametrize("method", ["awq", "fp8", "bitsandbytes"])
def test_unsupported_method(method):
    with pytest.raises(SUPAConfigError) as err:
        scheme.checkpoint_weight_bits(method, {"bits": 4})
    msg = assert_one_sentence(err.value)
    assert repr(method) in msg and "--quantization" in msg


# ---- check_checkpoint and VLLM_BR_QUANT_METHOD ----------------------------


def test_check_checkpoint_unquantized():
    assert scheme.check_checkpoint(model_config(None, None)) is None
    assert scheme.check_checkpoint(SimpleNamespace()) is None


@pytest.mark.parametrize("env", [None, "INT8", "int8"])
@pytest.mark.parametrize(
    "method,cfg,bits",
    [(CT, W8A8_INT8, 8), (CT, W4A16, 4), ("gptq", GPTQ4, 4), ("experts_int8", None, 8)],
)
def test_int8_mode_serves_everything_as_int8(monkeypatch, env, method, cfg, bits):
    if env is not None:
        monkeypatch.setenv("VLLM_BR_QUANT_METHOD", env)
    assert scheme.check_checkpoint(model_config(method, cfg)) == bits
    assert scheme.stored_weight_bits(bits) == 8  # int4 widened to int8


@pytest.mark.parametrize(
    "method,cfg,name",
    [
        (CT, W8A8_INT8, "W8A8-INT8"),
        (CT, W8A16, "W8A16"),
        ("gptq", {**GPTQ4, "bits": 8}, "GPTQ int8"),
        ("experts_int8", None, "experts_int8"),
    ],
)
def test_int4_mode_refuses_int8_checkpoint(monkeypatch, method, cfg, name):
    monkeypatch.setenv("VLLM_BR_QUANT_METHOD", "INT4")
    with pytest.raises(SUPAConfigError) as err:
        scheme.check_checkpoint(model_config(method, cfg))
    msg = assert_one_sentence(err.value)
    assert name in msg and "VLLM_BR_QUANT_METHOD=INT8" in msg


def test_int4_mode_keeps_int4_checkpoint_packed(monkeypatch):
    monkeypatch.setenv("VLLM_BR_QUANT_METHOD", "INT4")
    assert scheme.check_checkpoint(model_config(CT, W4A16)) == 4
    assert scheme.check_checkpoint(model_config("gptq", GPTQ4)) == 4
    assert scheme.stored_weight_bits(4) == 4
    with pytest.raises(SUPAConfigError) as err:
        scheme.stored_weight_bits(8)
    assert "VLLM_BR_QUANT_METHOD=INT8" in assert_one_sentence(err.value)


def test_check_checkpoint_reads_config_objects(monkeypatch):
    # transformers gives a QuantizationConfig object, not a dict, for some
    # checkpoints: the scheme reads it through to_dict().
    monkeypatch.setenv("VLLM_BR_QUANT_METHOD", "INT4")
    cfg_obj = SimpleNamespace(to_dict=lambda: dict(W8A16))
    with pytest.raises(SUPAConfigError, match="W8A16"):
        scheme.check_checkpoint(model_config(CT, cfg_obj))


def test_check_checkpoint_refuses_unserved_scheme():
    with pytest.raises(SUPAConfigError) as err:
        scheme.check_checkpoint(model_config(CT, W8A8_FP8))
    assert "W8A8-FP" in assert_one_sentence(err.value)


# ---- the platform --------------------------------------------------------


def test_platform_verify_quantization(monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    from vllm_br.platform import SUPAPlatform

    with pytest.raises(SUPAConfigError) as err:
        SUPAPlatform.verify_quantization("fp8")
    msg = assert_one_sentence(err.value)
    assert msg == str(scheme.unsupported_method_error("fp8"))
    assert "'fp8'" in msg and "--quantization" in msg
    for method in scheme.SUPPORTED_METHODS:
        SUPAPlatform.verify_quantization(method)  # served: no error


@pytest.mark.parametrize("experts", ["num_experts", "n_routed_experts"])
def test_quantized_moe_schemes_pass_the_start_up_check(experts):
    """MoE checkpoints of every served scheme pass; which expert layouts
    are served is decided per layer when vLLM builds the quant methods
    (tests/e2e/test_quantized.py)."""
    w8a8 = model_config("compressed-tensors", ct_config(weights(8), acts(8)))
    setattr(w8a8.hf_config, experts, 8)
    assert scheme.check_checkpoint(w8a8) == 8
    w4a16 = model_config(
        "compressed-tensors", ct_config(weights(4, strategy="group"), None)
    )
    setattr(w4a16.hf_config, experts, 8)
    assert scheme.check_checkpoint(w4a16) == 4
    online = model_config("experts_int8", None)  # bf16 experts quantized on load
    setattr(online.hf_config, experts, 8)
    assert scheme.check_checkpoint(online) == 8

"""SUPAPlatform: identity as vLLM resolves it, config policies (idempotent),
one-sentence errors, attention selection and environment validation."""

from __future__ import annotations

import os

# Before vLLM resolves current_platform: the cpu emulation backend.
os.environ.setdefault("VLLM_BR_DEVICE", "cpu")

import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from vllm_br import envs  # noqa: E402
from vllm_br.errors import SUPAConfigError  # noqa: E402
from vllm_br.platform import SUPAPlatform  # noqa: E402

_ROOT = Path(__file__).resolve().parents[2]

# One sentence: ends with '.', no sentence break ('. ') inside; dots inside
# numbers ("0.33") are fine.
_ONE_SENTENCE = re.compile(r"^[^\n]*[^.\s]\.$")


def _is_one_sentence(msg: str) -> bool:
    return bool(_ONE_SENTENCE.match(msg)) and ". " not in msg


def _supa_error(exc: BaseException) -> SUPAConfigError | None:
    """The SUPAConfigError behind ``exc``: itself, chained, or wrapped by
    pydantic (VllmConfig is a pydantic dataclass; its __post_init__ runs
    check_and_update_config)."""
    stack, seen = [exc], set()
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, SUPAConfigError):
            return err
        stack += [err.__cause__, err.__context__]
        if type(err).__name__ == "ValidationError":
            stack += [e.get("ctx", {}).get("error") for e in err.errors()]
    return None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # Hermetic: only VLLM_BR_DEVICE=cpu among the plugin's variables, and
    # VLLM_WORKER_MULTIPROC_METHOD restored after the platform sets it.
    for name in envs.names():
        if name != "VLLM_BR_DEVICE":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_USE_V1", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)


def _engine_config(model: Path | str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **kwargs).create_engine_config()


# ---- identity ---------------------------------------------------------------
def test_current_platform_is_supa_on_cpu_backend():
    # vLLM silently falls back to another platform on a plugin error: check
    # the class, not just the attributes.
    assert isinstance(current_platform, SUPAPlatform)
    assert type(current_platform).__module__ == "vllm_br.platform"
    assert current_platform.backend_name == "cpu"
    assert current_platform.device_type == "cpu"
    assert current_platform.dist_backend == "gloo"
    assert current_platform.supported_dtypes == [torch.bfloat16, torch.float32]
    assert current_platform.device_control_env_var == "SUPA_VISIBLE_DEVICES"
    assert isinstance(current_platform.ray_device_key, str)
    assert current_platform.ray_device_key
    assert current_platform.is_pin_memory_available() is False
    assert current_platform.is_out_of_tree()
    assert set(envs.names()) <= set(current_platform.additional_env_vars)


def test_class_attributes_follow_supa_backend_with_fake_torch_br():
    # platform.py computes device_type etc. at import time: a fresh process
    # that installs the fake torch_br first.
    code = textwrap.dedent(
        """
        import json
        from tests.fakes import installed_fake_torch_br

        with installed_fake_torch_br():
            from vllm.platforms import current_platform
            from vllm_br.platform import SUPAPlatform

            print(json.dumps({
                "cls": type(current_platform).__module__ + "."
                       + type(current_platform).__name__,
                "is_supa": isinstance(current_platform, SUPAPlatform),
                "backend_name": SUPAPlatform.backend_name,
                "device_type": current_platform.device_type,
                "device_name": current_platform.device_name,
                "dispatch_key": current_platform.dispatch_key,
                "dist_backend": current_platform.dist_backend,
            }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in envs.names()}
    env["VLLM_BR_DEVICE"] = "supa"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "cls": "vllm_br.platform.SUPAPlatform",
        "is_supa": True,
        "backend_name": "supa",
        "device_type": "supa",
        "device_name": "supa",
        "dispatch_key": "PrivateUse1",
        "dist_backend": "sccl",
    }


# ---- check_and_update_config ------------------------------------------------
def _snapshot(cfg) -> dict:
    cc = cfg.compilation_config
    return {
        "worker_cls": cfg.parallel_config.worker_cls,
        "enable_dbo": cfg.parallel_config.enable_dbo,
        "disable_custom_all_reduce": cfg.parallel_config.disable_custom_all_reduce,
        "block_size": cfg.cache_config.block_size,
        "cache_dtype": cfg.cache_config.cache_dtype,
        "dtype": cfg.model_config.dtype,
        "compilation_mode": cc.mode,
        "cudagraph_mode": cc.cudagraph_mode,
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "custom_ops": list(cc.custom_ops),
        "async_scheduling": cfg.scheduler_config.async_scheduling,
        "multiproc_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
    }


def test_check_and_update_config_policies_and_idempotent(tiny_llama_dir):
    from vllm.config import CompilationMode, CUDAGraphMode

    cfg = _engine_config(tiny_llama_dir)
    assert cfg.parallel_config.worker_cls == "vllm_br.worker.worker.SUPAWorker"
    assert cfg.cache_config.block_size == 128
    # The cpu backend's measured default (CpuBackend.default_graph_modes).
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert "all" in cfg.compilation_config.custom_ops
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert cfg.scheduler_config.async_scheduling is False  # cpu backend
    assert cfg.parallel_config.disable_custom_all_reduce is True
    assert cfg.model_config.dtype in (torch.bfloat16, torch.float32)

    before = _snapshot(cfg)
    SUPAPlatform.check_and_update_config(cfg)
    assert _snapshot(cfg) == before
    current_platform.check_and_update_config(cfg)
    assert _snapshot(cfg) == before


def test_block_size_128_explicit_is_accepted(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir, block_size=128)
    assert cfg.cache_config.block_size == 128


def test_float32_explicit_is_accepted(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir, dtype="float32")
    assert cfg.model_config.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "env", "names"),
    [
        ({"block_size": 16}, {}, ["--block-size 16", "128"]),
        ({"dtype": "float16"}, {}, ["--dtype float16"]),
        ({}, {"VLLM_USE_V1": "0"}, ["VLLM_USE_V1"]),
        ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, ["VLLM_USE_V2_MODEL_RUNNER=1"]),
        ({}, {"VLLM_BR_WEIGHT_TYPE": "ROW"}, ["VLLM_BR_WEIGHT_TYPE", "'ROW'"]),
        ({}, {"VLLM_BR_CPU_NUM_DEVICES": "0"}, ["VLLM_BR_CPU_NUM_DEVICES"]),
        ({"kv_cache_dtype": "fp8"}, {}, ["--kv-cache-dtype fp8"]),
        ({"enable_lora": True}, {}, ["LoRA", "--enable-lora"]),
    ],
    ids=[
        "block-size-16",
        "dtype-float16",
        "v0",
        "v2-runner",
        "bad-env",
        "bad-env-int",
        "kv-fp8",
        "lora",
    ],
)
def test_config_errors_are_one_sentence(
    tiny_llama_dir, monkeypatch, kwargs, env, names
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Exception) as info:  # noqa: B017 (pydantic wraps it)
        _engine_config(tiny_llama_dir, **kwargs)
    err = _supa_error(info.value)
    assert err is not None, f"no SUPAConfigError behind {info.value!r}"
    msg = str(err)
    assert _is_one_sentence(msg), msg
    for name in names:
        assert name in msg, msg


# ---- MoE graph sizes ---------------------------------------------------------
GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}


@pytest.mark.parametrize(
    ("max_num_seqs", "limit"), [(None, None), (16, None), (None, "64"), (8, "64")]
)
def test_moe_graphs_default_to_the_static_moe_limit(
    tiny_qwen3_moe_dir, tiny_llama_dir, monkeypatch, max_num_seqs, limit
):
    """A MoE model's default graph sizes stop at
    VLLM_BR_STATIC_MOE_DECODER_MAX_LEN (256 by default); below it they are
    vLLM's own, which a dense model keeps."""
    if limit is not None:
        monkeypatch.setenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", limit)
    kwargs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    moe = _engine_config(tiny_qwen3_moe_dir, **kwargs, **GRAPHS).compilation_config
    dense = _engine_config(tiny_llama_dir, **kwargs, **GRAPHS).compilation_config
    cap = int(limit or 256)
    assert max(moe.cudagraph_capture_sizes) == moe.max_cudagraph_capture_size
    assert moe.max_cudagraph_capture_size == min(dense.max_cudagraph_capture_size, cap)
    if (max_num_seqs, limit) == (None, "64"):
        assert dense.max_cudagraph_capture_size > cap  # the cap is what acts
    eager = _engine_config(tiny_qwen3_moe_dir, enforce_eager=True)
    assert eager.compilation_config.cudagraph_capture_sizes == []


@pytest.mark.parametrize(
    "graph_config",
    [{"max_cudagraph_capture_size": 512}, {"cudagraph_capture_sizes": [1, 8, 300]}],
    ids=["max-size", "sizes"],
)
def test_moe_graph_sizes_above_the_static_limit_are_one_sentence(
    tiny_qwen3_moe_dir, graph_config
):
    config = {**GRAPHS["compilation_config"], **graph_config}
    with pytest.raises(Exception) as info:  # noqa: B017 (pydantic wraps it)
        _engine_config(tiny_qwen3_moe_dir, compilation_config=config)
    err = _supa_error(info.value)
    assert err is not None, f"no SUPAConfigError behind {info.value!r}"
    msg = str(err)
    assert _is_one_sentence(msg), msg
    assert "VLLM_BR_STATIC_MOE_DECODER_MAX_LEN=256" in msg
    assert "-cc.max_cudagraph_capture_size" in msg


def test_v1_model_runner_is_chosen_not_fallen_back_to(tiny_llama_dir):
    """SUPA serves with the V1 model runner: the platform says so for every
    process it starts (VLLM_USE_V2_MODEL_RUNNER=0), so vLLM takes its choice
    instead of falling back with "Model Runner V2 requires Triton"."""
    import os

    cfg = _engine_config(tiny_llama_dir)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert cfg.use_v2_model_runner is False


def test_block_size_error_directly_on_config(tiny_llama_dir):
    # The same policy on an existing config: SUPAConfigError itself.
    cfg = _engine_config(tiny_llama_dir)
    cfg.cache_config.block_size = 16
    cfg.cache_config.user_specified_block_size = True
    with pytest.raises(SUPAConfigError, match="--block-size 16"):
        SUPAPlatform.check_and_update_config(cfg)


def test_dtype_auto_on_float16_checkpoint_is_bfloat16(tiny_llama_dir, tmp_path):
    model = tmp_path / "fp16"
    shutil.copytree(tiny_llama_dir, model)
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "float16"
    config["dtype"] = "float16"
    config_path.write_text(json.dumps(config))
    cfg = _engine_config(model, dtype="auto")
    assert cfg.model_config.dtype == torch.bfloat16


def test_check_if_supports_dtype():
    for dtype in (torch.bfloat16, torch.float32):
        SUPAPlatform.check_if_supports_dtype(dtype)
    with pytest.raises(SUPAConfigError) as info:
        SUPAPlatform.check_if_supports_dtype(torch.float16)
    assert "--dtype float16" in str(info.value)
    assert _is_one_sentence(str(info.value))


def test_lora_punica_wrapper_raises():
    with pytest.raises(SUPAConfigError, match="LoRA") as info:
        SUPAPlatform.get_punica_wrapper()
    assert _is_one_sentence(str(info.value))


# ---- attention ----------------------------------------------------------------
def _selector(**overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = dict(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128
    )
    fields.update(overrides)
    return AttentionSelectorConfig(**fields)


def test_get_attn_backend_cls():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    expected = "vllm_br.attention.backend.SUPAFlashAttentionBackend"
    assert SUPAPlatform.get_attn_backend_cls(None, _selector()) == expected
    assert current_platform.get_attn_backend_cls(None, _selector(), 8) == expected
    # Another backend asked for: still the SUPA one (with a warning).
    assert (
        SUPAPlatform.get_attn_backend_cls(AttentionBackendEnum.FLASH_ATTN, _selector())
        == expected
    )


def test_mla_selects_supa_flash_mla_and_its_prefill_backend():
    from vllm.v1.attention.backends.mla.prefill.selector import (
        MLAPrefillSelectorConfig,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_br.attention.mla import SupaFlashMLABackend, SupaMLAPrefillBackend

    expected = "vllm_br.attention.mla.SupaFlashMLABackend"
    mla = _selector(use_mla=True, head_size=576)
    assert SUPAPlatform.get_attn_backend_cls(None, mla) == expected
    assert (
        SUPAPlatform.get_attn_backend_cls(AttentionBackendEnum.FLASHMLA, mla)
        == expected
    )
    assert AttentionBackendEnum["SUPA_FLASH_MLA"].get_class() is SupaFlashMLABackend
    assert SupaFlashMLABackend.get_name() == "SUPA_FLASH_MLA"
    assert SupaFlashMLABackend.is_mla()
    assert SupaFlashMLABackend.get_supported_kernel_block_sizes() == [128]
    # Any latent size (the tiny test models use 48), bf16 and fp32.
    assert not SupaFlashMLABackend.validate_configuration(
        head_size=48, dtype=torch.float32, kv_cache_dtype="auto", block_size=128,
        use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None,
        attn_type="decoder",
    )  # fmt: skip
    prefill = SUPAPlatform.get_mla_prefill_backend_cls(
        MLAPrefillSelectorConfig(dtype=torch.bfloat16)
    )
    assert prefill is SupaMLAPrefillBackend


def test_sparse_mla_selects_the_sparse_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = SUPAPlatform.get_attn_backend_cls(
        None, _selector(use_mla=True, use_sparse=True)
    )
    assert path == "vllm_br.attention.sparse_mla.SupaFlashMLASparseBackend"
    backend = AttentionBackendEnum["SUPA_FLASH_MLA_SPARSE"].get_class()
    assert backend.is_sparse() and backend.is_mla()
    assert AttentionBackendEnum["SUPA_SPARSE_INDEXER"].get_class().get_name() == (
        "SUPA_SPARSE_INDEXER"
    )


# ---- validate_environ -------------------------------------------------------
class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def known_vllm_environ(monkeypatch):
    """Drop VLLM_* variables neither vLLM nor the plugin knows (a developer's
    shell may have some), so the test sees only what it sets."""
    from vllm import envs as vllm_envs

    for name in list(os.environ):
        if (
            name.startswith("VLLM_")
            and name not in vllm_envs.environment_variables
            and name not in envs.names()
        ):
            monkeypatch.delenv(name)


@pytest.fixture
def platform_log():
    log = logging.getLogger("vllm.vllm_br.platform")
    handler = _ListHandler()
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def test_validate_environ_knows_plugin_variables(
    known_vllm_environ, platform_log, monkeypatch
):
    for name in envs.names():
        monkeypatch.setenv(name, os.environ.get(name) or "1")
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    SUPAPlatform.validate_environ(hard_fail=True)  # no ValueError
    SUPAPlatform.validate_environ(hard_fail=False)
    assert not [m for m in platform_log if "Unknown vLLM environment" in m]


def test_validate_environ_flags_unknown_vllm_variable(
    known_vllm_environ, platform_log, monkeypatch
):
    monkeypatch.setenv("VLLM_FOO", "1")
    with pytest.raises(ValueError, match="VLLM_FOO"):
        SUPAPlatform.validate_environ(hard_fail=True)
    SUPAPlatform.validate_environ(hard_fail=False)
    warned = [m for m in platform_log if "Unknown vLLM environment" in m]
    assert len(warned) == 1
    assert "VLLM_FOO" in warned[0]


def test_vit_attention_backend():
    """Vision encoders: TORCH_SDPA's packed layout (run by the plugin's
    MMEncoderAttention); another --mm-encoder-attn-backend stops in one
    sentence naming it and what works."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_br.errors import SUPAConfigError
    from vllm_br.platform import SUPAPlatform

    sdpa = AttentionBackendEnum.TORCH_SDPA
    assert SUPAPlatform.get_supported_vit_attn_backends() == [sdpa]
    assert SUPAPlatform.get_vit_attn_backend(64, torch.bfloat16) is sdpa
    assert SUPAPlatform.get_vit_attn_backend(64, torch.bfloat16, sdpa) is sdpa
    with pytest.raises(
        SUPAConfigError, match=r"--mm-encoder-attn-backend FLASH_ATTN .* TORCH_SDPA"
    ):
        SUPAPlatform.get_vit_attn_backend(
            64, torch.bfloat16, AttentionBackendEnum.FLASH_ATTN
        )

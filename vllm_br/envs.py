"""Every environment variable the plugin reads: type, default, doc, validation.

Values are parsed when read (``vllm_br.envs.VLLM_BR_WEIGHT_TYPE``), so a test
or a launcher that sets a variable later is seen. A bad value raises
:class:`~vllm_br.errors.SUPAConfigError` with one sentence that names the
variable and the accepted values. ``validate_all()`` checks them all at once;
the platform calls it at start-up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_br.errors import SUPAConfigError

DEFAULT_SCCL_SO_PATH = (
    "/usr/local/birensupa/base/latest/succl/lib/x86_64-linux-gnu/libsuccl.so"
)


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str, str], Any]
    accepted: str
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        return self.parse(self.name, raw.strip())


def _bad(name: str, raw: str, accepted: str) -> SUPAConfigError:
    return SUPAConfigError(f"{name}={raw!r} is not valid; accepted values: {accepted}.")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        for c in choices:
            if raw.lower() == c.lower():
                return c
        raise _bad(name, raw, " | ".join(choices))

    return parse


def _bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise _bad(name, raw, "0 or 1")


def _int(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise _bad(name, raw, f"an integer >= {minimum}") from None
        if value < minimum:
            raise _bad(name, raw, f"an integer >= {minimum}")
        return value

    return parse


def _float(minimum: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise _bad(name, raw, f"a number > {minimum}") from None
        if not (value > minimum and math.isfinite(value)):
            raise _bad(name, raw, f"a number > {minimum}")
        return value

    return parse


def _device_list(name: str, raw: str) -> list[int]:
    try:
        ids = [int(x) for x in raw.split(",") if x.strip() != ""]
    except ValueError:
        raise _bad(name, raw, "comma-separated device indices such as 0,1") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise _bad(name, raw, "comma-separated device indices such as 0,1")
    return ids


def _path(name: str, raw: str) -> str:
    return raw


_text = _path  # any non-empty string, kept as given


_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar(
            "VLLM_BR_DEVICE",
            "auto",
            _choice("auto", "supa", "cpu"),
            "auto | supa | cpu",
            "Device backend: 'supa' drives a Biren card through torch_br, 'cpu' "
            "emulates SUPA devices on the host, 'auto' picks 'supa' when a card "
            "is present and otherwise 'cpu' where no other vLLM platform serves.",
        ),
        EnvVar(
            "SUPA_VISIBLE_DEVICES",
            None,
            _device_list,
            "comma-separated indices",
            "Visible SUPA devices (like CUDA_VISIBLE_DEVICES); unset means all.",
        ),
        EnvVar(
            "VLLM_BR_WEIGHT_TYPE",
            "NUMA",
            _choice("NUMA", "UMA"),
            "NUMA | UMA",
            "Weight storage layout: NUMA splits linear weights per die (NUMA "
            "domain) of a two-die card; UMA keeps one plain layout.",
        ),
        EnvVar(
            "VLLM_BR_QUANT_METHOD",
            "INT8",
            _choice("INT8", "INT4"),
            "INT8 | INT4",
            "How quantized checkpoints hold their weights on the device: INT8 "
            "serves every supported int8 and int4 checkpoint, int4 weights "
            "widened to int8 (exact); INT4 keeps int4 weights packed two per "
            "byte and refuses int8 checkpoints. Unquantized models are unaffected.",
        ),
        EnvVar(
            "VLLM_BR_USE_FUSED_ALLREDUCE",
            None,
            _int(0),
            "an integer >= 0",
            "Number of devices a fused P2P allreduce would span; unset means "
            "auto-detected from the P2P topology, 0 disables it. No fused "
            "kernel exists yet: the allreduce runs on SCCL either way.",
        ),
        EnvVar(
            "VLLM_BR_USE_FP32_ALL_REDUCE",
            False,
            _bool,
            "0 | 1",
            "Reduce bfloat16 tensors in float32.",
        ),
        EnvVar(
            "VLLM_BR_USE_CPU_ALL_REDUCE",
            False,
            _bool,
            "0 | 1",
            "Run allreduce on the host as a fallback.",
        ),
        EnvVar(
            "VLLM_BR_DEVICE_SPC_NUM",
            None,
            _int(1),
            "an integer >= 1",
            "Compute units (SPCs) per device; unset means auto-detected. More "
            "than 16 SPCs means two dies (two NUMA domains) on one card.",
        ),
        EnvVar(
            "VLLM_BR_STATIC_MOE_DECODER_MAX_LEN",
            256,
            _int(1),
            "an integer >= 1",
            "Largest decode batch (tokens) that takes the static-shape MoE path.",
        ),
        EnvVar(
            "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE",
            False,
            _bool,
            "0 | 1",
            "Form tensor-parallel groups from ranks inside one supernode.",
        ),
        EnvVar(
            "VLLM_BR_SUPERNODE_ID",
            None,
            _text,
            "any name",
            "This host's supernode, read with VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1: "
            "hosts with the same value share one (their cards are joined by "
            "B-Link); unset means the host is its own supernode, named by its "
            "hostname and IP. Set it on every host or on none.",
        ),
        EnvVar(
            "VLLM_SCCL_SO_PATH",
            DEFAULT_SCCL_SO_PATH,
            _path,
            "a file path",
            "Path of the SCCL collective library (libsuccl.so).",
        ),
        EnvVar(
            "VLLM_BR_CPU_NUM_DEVICES",
            8,
            _int(1),
            "an integer >= 1",
            "cpu backend: number of SUPA devices emulated on the host.",
        ),
        EnvVar(
            "VLLM_BR_CPU_MEMORY_GIB",
            4.0,
            _float(0.0),
            "a number > 0",
            "cpu backend: memory of one emulated device in GiB (capped by the "
            "host's memory); --gpu-memory-utilization is a fraction of it.",
        ),
        EnvVar(
            "VLLM_BR_MODEL_CACHE",
            None,
            _path,
            "a folder path",
            "Folder where the plugin keeps models it prepares itself (python -m "
            "vllm_br.model_cache prepare); the default model goes in its "
            "SmolLM2-135M-Instruct subfolder. Unset means ~/.cache/vllm-br/models.",
        ),
        EnvVar(
            "VLLM_BR_CPU_KERNELS",
            True,
            _bool,
            "0 or 1",
            "cpu backend: 1 builds and uses its C++ host kernels (paged-attention "
            "decode) with the system's g++; 0 runs every op's PyTorch reference.",
        ),
        EnvVar(
            "VLLM_BR_CPU_BF16_MATMUL",
            "auto",
            _choice("auto", "native", "fp32"),
            "auto | native | fp32",
            "cpu backend: how bfloat16 GEMMs run. 'fp32' multiplies float32 "
            "copies of the weights and rounds the result to bfloat16 (what a "
            "bf16 GEMM with float32 accumulation computes; about 20x faster on "
            "hosts without AVX512-BF16/AMX, at twice the weight memory); "
            "'native' uses torch's bf16 matmul; 'auto' uses 'native' where the "
            "host has AVX512-BF16 or AMX, else keeps the float32 copies and "
            "multiplies them for GEMMs above 2 rows per thread (LM head: 3), "
            "the bf16 weights for fewer (decode).",
        ),
        EnvVar(
            "VLLM_BR_CPU_PACKED_GEMM",
            True,
            _bool,
            "0 or 1",
            "cpu backend on hosts with AVX512-BF16/AMX: 1 packs each bfloat16 GEMM "
            "weight once for oneDNN after loading (about the bf16 weights' size "
            "again) and multiplies the packed weight in GEMMs up to 256 rows; 0 "
            "packs nothing and runs torch's plain bf16 matmul. Read again when "
            "each GEMM runs.",
        ),
        EnvVar(
            "VLLM_BR_CPU_ATTENTION_AMX",
            True,
            _bool,
            "0 or 1",
            "cpu backend on hosts with AMX: 1 runs the paged-attention kernel's "
            "bfloat16 prefills (head size 64, 128 or 256) on AMX tiles; 0 keeps "
            "them on its AVX-512 path. Decodes always take the AVX-512 path. "
            "Read again at each attention call with prefills.",
        ),
        EnvVar(
            "VLLM_BR_KERNEL_CACHE",
            "~/.cache/vllm-br/kernels",
            _path,
            "a folder path",
            "Folder where the cpu backend keeps its compiled host kernels "
            "(created private to the user; only libraries the user built "
            "there are loaded).",
        ),
    ]
}


def names() -> list[str]:
    return list(_VARS)


def describe(name: str) -> EnvVar:
    return _VARS[name]


def validate_all() -> dict[str, Any]:
    """Parse every variable; the first bad one raises SUPAConfigError."""
    return {name: var.read() for name, var in _VARS.items()}


def __getattr__(name: str) -> Any:
    var = _VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_VARS))

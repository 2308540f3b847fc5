"""Bad input stops `vllm serve` with one sentence naming the setting, exit
status 1, and nothing left running."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e

VLLM = str(Path(sys.executable).with_name("vllm"))


def _serve_error(
    model: Path | str, *args: str, env: dict[str, str] | None = None
) -> str:
    """Run `vllm serve`, expect it to fail, return its last stderr line."""
    full_env = {**os.environ, "VLLM_BR_DEVICE": "cpu", **(env or {})}
    proc = subprocess.Popen(
        [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", "0", *args],
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 1, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    # Nothing left behind: no process still carries the server's command line.
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(model) in " ".join(p.info["cmdline"])
    ]
    assert leftovers == []
    return lines[-1]


def _one_sentence(line: str) -> str:
    assert line.startswith("Error: "), line
    sentence = line.removeprefix("Error: ")
    assert sentence.endswith("."), line
    # One sentence: no sentence break inside ('. ' followed by a capital).
    assert not re.search(r"\.\s+[A-Z]", sentence[:-1]), line
    assert len(sentence) < 300, line
    return sentence


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        (
            {"VLLM_BR_WEIGHT_TYPE": "bogus"},
            (),
            r"VLLM_BR_WEIGHT_TYPE='bogus'.*NUMA \| UMA",
        ),
        ({"VLLM_BR_DEVICE": "gpu"}, (), r"VLLM_BR_DEVICE='gpu'.*auto \| supa \| cpu"),
        (
            {"VLLM_BR_STATIC_MOE_DECODER_MAX_LEN": "-3"},
            (),
            r"VLLM_BR_STATIC_MOE_DECODER_MAX_LEN",
        ),
        (
            {},
            ("--block-size", "16"),
            r"--block-size 16 is not supported.*--block-size 128",
        ),
        ({}, ("--dtype", "float16"), r"--dtype float16 is not supported.*bfloat16"),
        ({"VLLM_USE_V1": "0"}, (), r"VLLM_USE_V1=0.*V0 engine"),
    ],
    ids=["weight-type", "device", "moe-len", "block-size", "dtype", "v0"],
)
def test_bad_setting_one_sentence(tiny_llama_dir, env, args, expected):
    sentence = _one_sentence(_serve_error(tiny_llama_dir, *args, env=env))
    assert re.search(expected, sentence), sentence


def test_unknown_architecture_one_sentence(tiny_llama_dir, tmp_path):
    model = tmp_path / "unknown-arch"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    sentence = _one_sentence(_serve_error(model))
    assert "FooBarForCausalLM" in sentence


def test_float16_checkpoint_auto_serves_bfloat16(tiny_llama_dir, tmp_path):
    """--dtype auto on a float16 checkpoint resolves to bfloat16 (and vLLM logs
    the fallback); the explicit float16 above is refused."""
    from vllm.config import ModelConfig

    model = tmp_path / "fp16"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (model / "config.json").write_text(json.dumps(config))
    import torch

    assert ModelConfig(model=str(model), dtype="auto").dtype == torch.bfloat16

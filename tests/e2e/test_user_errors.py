"""Bad input stops `vllm serve` with one sentence naming the setting, exit
status 1, and nothing left running. On the cpu backend only: the refusals
come before any device is touched (the stand-in tier skips the module).

Four refusals run through `vllm serve` itself (an environment variable, the
device choice, a CLI argument, an architecture no one serves: the CLI hook's
printing, the exit status and the clean-up); the others stop ``LLM(...)`` in
this process, and the sentence checked is what the same hook would print
(``user_error_sentence``): each `vllm serve` costs ~9 s of a core importing
vLLM."""

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

pytestmark = [pytest.mark.e2e, pytest.mark.cpu_backend]

VLLM = str(Path(sys.executable).with_name("vllm"))


def _serve_errors(
    runs: dict[str, tuple[Path, tuple[str, ...], dict[str, str]]],
) -> dict[str, tuple[int, str, str]]:
    """Run `vllm serve model *args` with ``env`` for every ``runs`` entry, all
    at once (each spends ~9 s of one core importing vLLM before it fails, so
    two cores take about half the time of one after the other); name ->
    (exit status, last stderr line, stderr's end). Fails if any process is left behind."""
    procs = {
        name: subprocess.Popen(
            [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", "0", *args],
            env={**os.environ, "VLLM_BR_DEVICE": "cpu", **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (model, args, env) in runs.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            _, stderr = proc.communicate(timeout=240)
            lines = [line for line in stderr.splitlines() if line.strip()]
            results[name] = (
                proc.returncode,
                lines[-1] if lines else "",
                stderr[-2000:],
            )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    # Nothing left behind: no process still carries a server's model path.
    models = {str(model) for model, _, _ in runs.values()}
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and any(m in " ".join(p.info["cmdline"]) for m in models)
    ]
    assert leftovers == []
    return results


def _one_sentence(line: str) -> str:
    assert line.startswith("Error: "), line
    sentence = line.removeprefix("Error: ")
    assert sentence.endswith("."), line
    # One sentence: no sentence break inside ('. ' followed by a capital).
    assert not re.search(r"\.\s+[A-Z]", sentence[:-1]), line
    assert len(sentence) < 300, line
    return sentence


# id -> (environment, `vllm serve` arguments, what the sentence must say);
# SERVED go through `vllm serve`, the others through LLM(...) in-process.
SERVED = ("weight-type", "device", "block-size")
BAD_SETTINGS = {
    "weight-type": (
        {"VLLM_BR_WEIGHT_TYPE": "bogus"},
        (),
        r"VLLM_BR_WEIGHT_TYPE='bogus'.*NUMA \| UMA",
    ),
    "device": (
        {"VLLM_BR_DEVICE": "gpu"},
        (),
        r"VLLM_BR_DEVICE='gpu'.*auto \| supa \| cpu",
    ),
    "moe-len": (
        {"VLLM_BR_STATIC_MOE_DECODER_MAX_LEN": "-3"},
        (),
        r"VLLM_BR_STATIC_MOE_DECODER_MAX_LEN",
    ),
    "block-size": (
        {},
        ("--block-size", "16"),
        r"--block-size 16 is not supported.*--block-size 128",
    ),
    "dtype": (
        {},
        ("--dtype", "float16"),
        r"--dtype float16 is not supported.*bfloat16",
    ),
    "v0": ({"VLLM_USE_V1": "0"}, (), r"VLLM_USE_V1=0.*V0 engine"),
}


@pytest.fixture(scope="module")
def refused(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Every refused `vllm serve` of this module, run at once: each bad
    setting on the tiny Llama, and ``unknown-arch``, a copy of it whose
    architecture no one serves."""
    unknown = tmp_path_factory.mktemp("refused") / "unknown-arch"
    shutil.copytree(tiny_llama_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    runs = {
        name: (tiny_llama_dir, args, env)
        for name, (env, args, _) in BAD_SETTINGS.items()
        if name in SERVED
    }
    runs["unknown-arch"] = (unknown, (), {})
    return _serve_errors(runs)


def _refusal(refused: dict[str, tuple[int, str, str]], name: str) -> str:
    """The one sentence `vllm serve` stopped with (exit status 1)."""
    status, line, stderr = refused[name]
    assert status == 1, stderr
    return _one_sentence(line)


@pytest.mark.parametrize("name", SERVED)
def test_bad_setting_one_sentence(refused, name):
    sentence = _refusal(refused, name)
    assert re.search(BAD_SETTINGS[name][2], sentence), sentence


@pytest.mark.parametrize("name", [n for n in BAD_SETTINGS if n not in SERVED])
def test_bad_setting_one_sentence_in_process(tiny_llama_dir, monkeypatch, name):
    from vllm import LLM

    from vllm_br.patches import user_error_sentence

    env, args, expected = BAD_SETTINGS[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    kwargs = {"enforce_eager": True}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        kwargs[flag.removeprefix("--").replace("-", "_")] = value
    with pytest.raises(Exception) as err:  # noqa: B017 (vLLM's own types vary)
        LLM(model=str(tiny_llama_dir), **kwargs)
    sentence = user_error_sentence(err.value)
    assert sentence is not None, repr(err.value)
    _one_sentence("Error: " + sentence)
    assert re.search(expected, sentence), sentence


def test_unknown_architecture_one_sentence(refused):
    assert "FooBarForCausalLM" in _refusal(refused, "unknown-arch")


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

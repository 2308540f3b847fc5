"""`vllm-br info`: platform, backend, versions, devices, topology, settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_br import envs

_ROOT = Path(__file__).resolve().parents[2]
_NUM_DEVICES = 8  # VLLM_BR_CPU_NUM_DEVICES default


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("vllm-br")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm_br.cli"]  # pragma: no cover


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in envs.names()}
    env["VLLM_BR_DEVICE"] = "cpu"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """stdout of `vllm-br info` and `vllm-br info --json`, run side by side
    (each process imports vLLM: a few seconds)."""
    procs = {
        key: subprocess.Popen(
            [*_cli(), "info", *args],
            cwd=_ROOT,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, args in (("text", ()), ("json", ("--json",)))
    }
    out = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr[-4000:]
            out[key] = stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.fixture(scope="module")
def text_output(outputs) -> str:
    return outputs["text"]


@pytest.fixture(scope="module")
def json_output(outputs) -> dict:
    return json.loads(outputs["json"])


def test_text_names_platform_backend_and_versions(text_output):
    lines = text_output.splitlines()
    assert any(
        line.startswith("platform:")
        and line.split()[-1] == "vllm_br.platform.SUPAPlatform"
        for line in lines
    ), text_output
    assert any(
        line.startswith("device backend:") and line.split()[-1] == "cpu"
        for line in lines
    ), text_output
    for dist in ("torch", "vllm"):
        row = [line for line in lines if line.startswith(f"{dist}:")]
        assert row, text_output
        assert row[0].split()[-1] == metadata.version(dist)


def test_text_lists_devices_topology_and_settings(text_output):
    lines = text_output.splitlines()
    devices = [line for line in lines if line.startswith("supa:")]
    assert [d.split()[0] for d in devices] == [f"supa:{i}" for i in range(_NUM_DEVICES)]
    assert all("GiB" in d for d in devices)
    # P2P matrix: a header of device indices and one row per device.
    start = lines.index("P2P matrix:")
    header = lines[start + 1].split()
    assert header == [str(i) for i in range(_NUM_DEVICES)]
    rows = lines[start + 2 : start + 2 + _NUM_DEVICES]
    for i, row in enumerate(rows):
        cells = row.split()
        assert cells[0] == str(i)
        assert len(cells[1:]) == _NUM_DEVICES
        assert set(cells[1:]) <= {"Y", "."}
    settings = lines[lines.index("settings:") + 1 :]
    names = [s.strip().split("=", 1)[0] for s in settings if "=" in s]
    assert names == envs.names()
    assert "  VLLM_BR_DEVICE=cpu" in settings


def test_json(json_output):
    info = json_output
    assert info["platform"] == "vllm_br.platform.SUPAPlatform"
    assert info["device_backend"] == "cpu"
    assert "error" not in info
    assert info["versions"]["torch"] == metadata.version("torch")
    assert info["versions"]["vllm"] == metadata.version("vllm")
    devices = info["devices"]
    assert [d["index"] for d in devices] == list(range(_NUM_DEVICES))
    for d in devices:
        assert d["total_memory_bytes"] > 0
        assert d["name"]
    current = [d for d in devices if d["free_memory_bytes"] is not None]
    assert (
        current
        and 0 < current[0]["free_memory_bytes"] <= current[0]["total_memory_bytes"]
    )
    p2p = info["topology"]["p2p"]
    assert len(p2p) == _NUM_DEVICES and all(len(r) == _NUM_DEVICES for r in p2p)
    assert list(info["settings"]) == envs.names()
    assert info["settings"]["VLLM_BR_DEVICE"] == "cpu"
    assert info["settings"]["VLLM_BR_CPU_NUM_DEVICES"] == _NUM_DEVICES


# In-process from here (the CLI's collect_info/main; no subprocess needed).
@pytest.fixture
def cpu_env(monkeypatch):
    for name in envs.names():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    return monkeypatch


def test_bad_setting_shows_invalid(cpu_env, capsys):
    from vllm_br import cli

    cpu_env.setenv("VLLM_BR_WEIGHT_TYPE", "ROW")
    info = cli.collect_info()
    value = info["settings"]["VLLM_BR_WEIGHT_TYPE"]
    assert value.startswith("INVALID")
    assert "VLLM_BR_WEIGHT_TYPE='ROW'" in value
    # Only that one: the others keep their values.
    others = {k: v for k, v in info["settings"].items() if k != "VLLM_BR_WEIGHT_TYPE"}
    assert not [v for v in others.values() if str(v).startswith("INVALID")]

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "  VLLM_BR_WEIGHT_TYPE=INVALID" in out


def test_num_devices_setting(cpu_env):
    from vllm_br import cli

    cpu_env.setenv("VLLM_BR_CPU_NUM_DEVICES", "3")
    info = cli.collect_info()
    assert len(info["devices"]) == 3
    assert len(info["topology"]["p2p"]) == 3

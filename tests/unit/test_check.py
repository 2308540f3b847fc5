"""`vllm-br check`: the conformance command passes on the active backend, a
broken op makes its check (and the command) fail, every registered op has a
check, and the parts that decide an outcome (errors, memory accounting,
options) do what docs/check.md says."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_br import envs

_ROOT = Path(__file__).resolve().parents[2]
_MEMORY = {"memory_allocated", "memory_stats", "max_memory_allocated", "mem_get_info"}


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("vllm-br")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm_br.cli"]  # pragma: no cover


@pytest.fixture
def quiet_env(monkeypatch):
    """The variables `vllm-br check` sets for itself, restored afterwards."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return monkeypatch


@pytest.fixture(scope="module")
def json_run() -> tuple[int, list[dict], str]:
    """`vllm-br check --json`, every group, once (about 40 s on 2 cores)."""
    env = {k: v for k, v in os.environ.items() if k not in envs.names()}
    env["VLLM_BR_DEVICE"] = os.environ.get("VLLM_BR_DEVICE", "cpu")
    proc = subprocess.run(
        [*_cli(), "check", "--json"],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        results = json.loads(proc.stdout)  # stdout is the JSON alone
    except json.JSONDecodeError:
        pytest.fail(
            f"stdout is not JSON:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.returncode, results, proc.stderr


@pytest.mark.slow
def test_command_passes(json_run):
    from vllm_br.check.runner import GROUPS
    from vllm_br.device import get_backend

    code, results, stderr = json_run
    keys = {"name", "group", "passed", "status", "metric", "error", "tolerance"}
    for r in results:
        assert keys | {"seconds", "detail"} <= set(r), r
    assert {r["group"] for r in results} == set(GROUPS)
    host_memory = get_backend().host_memory_is_device_memory
    bad = []
    for r in results:
        if r["group"] == "memory" and host_memory:
            # RSS-based counters: reported as not tracked, never passed.
            assert r["name"] in _MEMORY
            ok = r["status"] == "SKIP" and r["detail"].startswith("not tracked")
        else:
            ok = r["status"] == "PASS" and r["passed"] is True
        if not ok:
            bad.append(r)
    assert not bad, json.dumps(bad, indent=1) + stderr[-3000:]
    assert code == 0, stderr[-3000:]
    names = {f"{r['group']}/{r['name']}" for r in results}
    for expected in (
        "ops/coverage",
        "ops/rms_norm[bfloat16]",
        "attention/paged_attention_mixed[float32]",
        "attention/mla_decode[bfloat16]",
        "graphs/capture_replay[float32]",
        "collectives/all_reduce[bfloat16]",
        "collectives/send_recv[float32]",
        "e2e/greedy_vs_hf[float32]",
    ):
        assert expected in names
    e2e = next(r for r in results if r["group"] == "e2e")
    assert "SUPAPlatform" in e2e["detail"] and "SUPA_FLASH_ATTN" in e2e["detail"]


def _wrong(fn, scale=1.001):
    """``fn`` with its (first) tensor result off by a relative ``scale - 1``."""

    def op(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * scale, *out[1:])
        if out is None:  # writes into `output`
            kwargs["output"].mul_(scale)
            return None
        return out * scale

    return op


def test_a_broken_op_fails_its_check(quiet_env, monkeypatch, capsys):
    """The command over the ops group with ``rms_norm`` off by 1e-3: its
    float32 check (tolerance 1e-5) fails, naming the op, and nothing else."""
    from vllm_br import cli
    from vllm_br.ops import registry

    monkeypatch.setitem(
        registry._RESOLVED, "rms_norm", _wrong(registry.get_op("rms_norm"))
    )
    assert cli.main(["check", "--only", "ops"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    failed = [line.split()[1] for line in lines if line.startswith("FAIL  ")]
    assert failed == ["ops/rms_norm[float32]"], out
    assert "ops/rms_norm[float32]: runs: rms_norm reference; over tolerance:" in out
    assert lines[-1].startswith("FAIL: ") and " 1 failed" in lines[-1]


def test_a_broken_attention_op_fails_the_checks_that_run_it(monkeypatch):
    """An op writing into ``output``: decodes off by 1e-3 fail every paged
    check with decodes, in float32, and not the prefill-only one."""
    from vllm_br.check import attention
    from vllm_br.check.base import CheckContext
    from vllm_br.device import get_backend
    from vllm_br.ops import registry

    op = "paged_attention_decode"
    monkeypatch.setitem(registry._RESOLVED, op, _wrong(registry.get_op(op)))
    backend = get_backend()
    ctx = CheckContext(backend=backend, device=backend.torch_device(), devices=1)
    checks = {c.name: c for c in attention.CHECKS}
    outcomes = {
        name: checks[name].fn(ctx, torch.float32, 1e-5)
        for name in (op, "paged_attention_mixed", "paged_attention_prefill")
    }
    assert outcomes[op].passed is False and outcomes[op].error > 5e-4
    assert "over tolerance: request 0" in outcomes[op].detail
    assert outcomes["paged_attention_mixed"].passed is False
    assert outcomes["paged_attention_prefill"].passed is True


def test_every_registered_op_has_a_check():
    from vllm_br.check import coverage
    from vllm_br.ops import registry

    assert coverage.missing_ops() == []
    outcome = coverage.coverage_outcome()
    assert outcome.passed and outcome.error == 0
    assert f"{len(registry.registered_ops())} registered ops" in outcome.detail


def test_a_new_op_without_a_check_fails_coverage(monkeypatch):
    from vllm_br.check import coverage
    from vllm_br.ops import registry

    monkeypatch.setitem(registry._REFERENCE, "brand_new_op", lambda x: x)
    assert coverage.missing_ops() == ["brand_new_op"]
    outcome = coverage.coverage_outcome()
    assert outcome.passed is False and "brand_new_op" in outcome.detail


def test_max_error():
    from vllm_br.check.measure import Measure, max_error

    ref = torch.tensor([0.5, 4.0, -math.inf], dtype=torch.float64)
    # absolute below 1, relative above; equal infinities are no error
    got = torch.tensor([0.51, 4.4, -math.inf])
    assert max_error(got, ref) == pytest.approx(0.1, rel=1e-6)
    assert max_error(torch.tensor([0.5, 4.0, 0.0]), ref) == math.inf
    assert max_error(torch.tensor([math.nan, 4.0, -math.inf]), ref) == math.inf

    m = Measure(1e-3)
    m.close("a", torch.tensor([1.0]), torch.tensor([1.0005], dtype=torch.float64))
    m.exact("b", torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert m.outcome().passed
    m.exact("c", torch.tensor([1.0]), torch.tensor([1.0 + 2**-20]))
    outcome = m.outcome()
    assert not outcome.passed and "c " in outcome.detail
    assert outcome.tolerance == 0.0


class _Counted:
    """A stand-in allocation the fake backend counts while it lives."""

    live: set[int] = set()

    def __init__(self):
        _Counted.live.add(id(self))

    def __del__(self):
        _Counted.live.discard(id(self))


class _FakeBackend:
    host_memory_is_device_memory = False

    def __init__(self, tracks: bool):
        self.tracks = tracks

    def memory_allocated(self, index=None):
        from vllm_br.check.memory import SIZE

        return 100 + (SIZE * len(_Counted.live) if self.tracks else 0)

    def synchronize(self, index=None):
        pass


@pytest.mark.parametrize("tracks", [True, False])
def test_memory_outcomes(tracks, monkeypatch):
    from vllm_br.check import memory
    from vllm_br.check.base import CheckContext

    monkeypatch.setattr(memory, "_allocate", lambda ctx: _Counted())
    backend = _FakeBackend(tracks)
    ctx = CheckContext(backend=backend, device=torch.device("cpu"), devices=1)
    outcome = memory._check_allocated(ctx)
    assert outcome.passed is tracks
    assert outcome.detail.startswith("not tracked") is not tracks
    # A host-memory backend is reported as not tracked whatever it measured.
    backend.host_memory_is_device_memory = True
    outcome = memory._check_allocated(ctx)
    assert outcome.passed is None and outcome.status == "SKIP"
    assert outcome.detail.startswith("not tracked")


def test_collectives_need_two_devices():
    from vllm_br.check.base import CheckContext
    from vllm_br.check.runner import run_checks
    from vllm_br.device import get_backend

    backend = get_backend()
    ctx = CheckContext(backend=backend, device=backend.torch_device(), devices=1)
    (result,) = run_checks(ctx, ("collectives",))
    assert result.status == "SKIP" and "need 2" in result.outcome.detail


def test_a_check_that_raises_fails_and_the_run_goes_on():
    from vllm_br.check import runner
    from vllm_br.check.base import CheckContext
    from vllm_br.device import get_backend

    def boom():
        raise RuntimeError("kernel crashed\nmore")

    backend = get_backend()
    ctx = CheckContext(backend=backend, device=backend.torch_device(), devices=1)
    seen = []
    original = runner._CHECKS["graphs"]
    try:
        runner._CHECKS["graphs"] = lambda ctx: iter(
            [("a", boom), ("b", lambda: runner.Outcome(passed=True))]
        )
        results = runner.run_checks(ctx, ("graphs",), seen.append)
    finally:
        runner._CHECKS["graphs"] = original
    assert [r.status for r in results] == ["FAIL", "PASS"] and seen == results
    assert results[0].outcome.detail.startswith("RuntimeError: kernel crashed at ")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--only", "ops,bogus"], ["--only", "ops, attention, graphs"]),
        (["--devices", "99"], ["--devices 99", "between 1 and the"]),
    ],
)
def test_user_errors_are_one_sentence(argv, words, quiet_env, capsys):
    from vllm_br import cli

    assert cli.main(["check", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: vllm-br check ") and err.count("\n") == 0, err
    assert all(w in err for w in words), err


def test_default_devices():
    from vllm_br.check.command import default_devices

    class Card:
        host_memory_is_device_memory = False

        def device_count(self):
            return 8

    class Host(Card):
        host_memory_is_device_memory = True

    assert default_devices(Card()) == 8
    assert default_devices(Host()) == 2

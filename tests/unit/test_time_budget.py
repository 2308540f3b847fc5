"""tests/fixtures/time_budget.py: the report printed at the end of every run
and the budget a whole tier is held to."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixtures import time_budget as tb


@pytest.fixture
def xeon(monkeypatch, tmp_path):
    """This host counted as the Xeon (factor 2.0), durations recorded in a
    temporary file."""
    monkeypatch.setattr(tb, "host_kind", lambda: ("Xeon", 2.0))
    monkeypatch.setattr(tb, "RECORD", tmp_path / "durations.json")


def _timer(wall_s: float, tests: dict[str, float]) -> tb.Timer:
    timer = tb.Timer()
    timer.started -= wall_s
    for nodeid, s in tests.items():
        timer.add(nodeid, s)
    return timer


def test_within_budget_prints_time_and_ten_slowest(xeon):
    tests = {f"t{i}": float(i) for i in range(12)}
    lines, over = _timer(600, tests).report("default", whole=True)
    assert not over
    assert lines[0].startswith("default: 12 tests in 600 s")
    assert "20.0 min on the slowest" in lines[0]
    # The default tier's minutes on the slowest host, here at factor 2.
    budget_s = tb.BUDGET_MIN["default"] * 60 / 2.0
    assert f"{budget_s:.0f} s here; used " in lines[1]
    used = float(lines[1].split("used ")[1].split("%")[0])  # wall is 600 s + a bit
    assert abs(used - 100 * 600 / budget_s) <= 1, lines[1]
    slowest = [line.split()[-1] for line in lines[3:]]
    assert slowest == [f"t{i}" for i in range(11, 1, -1)]


def test_over_budget_names_what_grew_most(xeon):
    tb.RECORD.write_text(json.dumps({"slow": {"tests": {"old": 100.0, "same": 50.0}}}))
    # The slow tier's budget on the slowest host, in this (x2.0) host's
    # seconds, is exceeded; 'old' grew from 50 s here to 120, 'new' did not
    # exist.
    over_s = tb.BUDGET_MIN["slow"] * 60 / 2.0 + 10
    timer = _timer(over_s, {"old": 120.0, "same": 25.0, "new": 30.0, "tiny": 0.5})
    lines, over = timer.report("slow", whole=True)
    assert over and "OVER BUDGET" in lines[1] and "not enforced" in lines[1]
    enforced, over = timer.report("slow", whole=True, enforce=True)
    assert over and "not enforced" not in enforced[1]
    grown = lines[lines.index(next(x for x in lines if x.startswith("grown"))) + 1 :]
    assert [line.split()[-1] for line in grown] == ["old", "new", "same"]
    assert grown[0].split()[0] == "+140.0"  # 240 - 100 slowest-host seconds
    assert "(recorded 50.0 s here)" in next(
        x for x in lines if x.endswith(")") and "old" in x
    )


def test_part_of_a_tier_is_not_checked(xeon):
    lines, over = _timer(10_000, {"t": 1.0}).report("default", whole=False)
    assert not over and "not checked" in lines[1]
    lines, over = _timer(10_000, {"t": 1.0}).report(None, whole=False)
    assert not over and lines[0].startswith("selection:")


def test_record_keeps_notable_tests_in_slowest_host_seconds(xeon):
    _timer(100, {"a": 3.0, "b": 0.5}).record("default")
    doc = json.loads(tb.RECORD.read_text())["default"]
    assert doc["factor"] == 2.0 and doc["tests"] == {"a": 6.0}
    assert doc["total_s"] == pytest.approx(200, abs=1)


@pytest.mark.parametrize(
    ("markexpr", "args", "keyword", "expect"),
    [
        ("not slow", ["tests"], "", ("default", True)),
        ("slow", ["tests"], "", ("slow", True)),
        ("not slow", ["tests/unit"], "", ("default", False)),
        ("not slow", ["tests"], "envs", ("default", False)),
        ("", ["tests/unit/test_envs.py::test_x"], "", (None, False)),
    ],
)
def test_tier_of(markexpr, args, keyword, expect, monkeypatch):
    monkeypatch.delenv("SUPA_STANDIN_BUILD_DIR", raising=False)
    root = Path(__file__).resolve().parents[2]
    config = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr, keyword=keyword),
        args=args,
        invocation_params=SimpleNamespace(dir=root),
    )
    assert tb.tier_of(config, root / "tests") == expect


@pytest.mark.parametrize(
    ("markexpr", "args", "expect"),
    [
        ("not slow", ["tests/e2e"], ("standin", True)),
        ("not slow", ["tests/e2e/test_server.py"], ("standin", False)),
        ("slow", ["tests/e2e"], (None, True)),
        ("not slow", ["tests"], ("standin", False)),
    ],
)
def test_tier_of_on_the_standin(markexpr, args, expect, monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "supa")
    monkeypatch.setenv("SUPA_STANDIN_BUILD_DIR", "/nonexistent")
    root = Path(__file__).resolve().parents[2]
    config = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr, keyword=""),
        args=args,
        invocation_params=SimpleNamespace(dir=root),
    )
    assert tb.tier_of(config, root / "tests") == expect


def test_ci_enforces_the_budget_of_every_tier():
    """CI (.ci/run) runs the README's command, whose default run is the
    whole default tier with --enforce-budget, then the whole slow tier with
    it; both select what tier_of counts as a whole tier."""
    import shlex

    root = Path(tb.__file__).resolve().parents[2]
    script = (root / "scripts" / "test.sh").read_text()
    default_args = next(
        line.split("set --", 1)[1]
        for line in script.splitlines()
        if line.strip().startswith("set -- tests")
    )
    ci = [
        shlex.split(line)
        for line in (root / ".ci" / "run").read_text().splitlines()
        if line.startswith("bash scripts/test.sh")
    ]
    assert ci[0] == ["bash", "scripts/test.sh"]
    runs = [shlex.split(default_args), ci[1][2:]]
    for args, tier in zip(runs, ("default", "slow"), strict=True):
        assert "--enforce-budget" in args, args
        assert args[0] == "tests" and tb.TIERS[args[args.index("-m") + 1]] == tier
    # The third run: the e2e suite's default tier on the stand-in device.
    standin = ci[2][2:]
    assert standin[:2] == ["--device", "supa-standin"], standin
    folder, expr = tb.STANDIN_TIER
    assert standin[2] == f"tests/{folder}"
    assert standin[standin.index("-m") + 1] == expr
    assert "--enforce-budget" in standin

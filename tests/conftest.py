"""Session fixtures shared by all tests (fixtures only; helpers live in
tests/fixtures/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # plain `pytest` does not put the repo root there
    sys.path.insert(0, str(_ROOT))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM folder (float32, vocab 512, 2 layers),
    built once per session. Shared: do not modify it."""
    from tests.fixtures.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3MoeForCausalLM folder (float32, vocab 512, 3 layers
    of which layer 1 is dense, 8 experts, top-2), built once per session.
    Shared: do not modify it."""
    from tests.fixtures.tiny_moe import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The plugin's default model (SmolLM2-135M-Instruct), prepared on first
    use (~30 s and a 93 MB download). scripts/setup.sh prepares it, so a
    failure here is a real failure, not a reason to skip."""
    from vllm_br.model_cache import ModelDownloadError, prepare_default_model

    try:
        return prepare_default_model()
    except ModelDownloadError as e:
        pytest.fail(str(e))


# ---- the test-time budget (tests/fixtures/time_budget.py) ------------------

_TIMER = None  # this run's Timer
_REPORT: tuple[list[str], bool] = ([], False)


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write this whole tier's test durations into tests/durations.json",
    )
    parser.addoption(
        "--enforce-budget",
        action="store_true",
        help="fail a whole tier's run that is over its time budget",
    )
    parser.addoption(
        "--standin-report",
        default=None,
        help="write each test's outcome as JSON here (the nested stand-in "
        "session of tests/e2e/test_standin.py)",
    )


def pytest_collection_modifyitems(config, items):
    """On the stand-in, skip what runs on the cpu backend whatever the device
    (the ``cpu_backend`` marker): the default tier already ran it. On cpu,
    skip what checks the supa backend itself (``supa_backend``): the stand-in
    tier runs it."""
    from tests.fixtures import standin

    if standin.active():
        marker, reason = "cpu_backend", "cpu_backend: the default tier runs it"
    else:
        marker, reason = "supa_backend", "supa_backend: the stand-in tier runs it"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker(marker):
            item.add_marker(skip)


def pytest_configure(config):
    global _TIMER
    from tests.fixtures.time_budget import Timer

    _TIMER = Timer()


_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report):
    _TIMER.add(report.nodeid, report.duration)
    if report.when == "call" or report.outcome != "passed":
        _OUTCOMES.setdefault(report.nodeid, report.outcome)
        if report.outcome != "passed":
            _OUTCOMES[report.nodeid] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    """Check the budget once the tests are done; with --enforce-budget a whole
    tier over its budget fails the run (the report says which tests grew)."""
    global _REPORT
    from tests.fixtures.time_budget import tier_of

    tier, whole = tier_of(session.config, Path(__file__).resolve().parent)
    enforce = session.config.option.enforce_budget
    _REPORT = _TIMER.report(tier, whole, enforce)
    if _REPORT[1] and enforce and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.config.option.record_durations and tier and whole and exitstatus == 0:
        _TIMER.record(tier)
    if session.config.option.standin_report:
        Path(session.config.option.standin_report).write_text(json.dumps(_OUTCOMES))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.section("test time budget")
    for line in _REPORT[0]:
        terminalreporter.write_line(line)

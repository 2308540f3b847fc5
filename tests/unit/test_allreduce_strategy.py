"""The allreduce strategy: a pure function of topology and settings, checked
over a table of topologies, and the once-per-process start-up decision."""

from __future__ import annotations

import logging

import pytest

from vllm_br.device.base import Topology
from vllm_br.distributed import allreduce
from vllm_br.distributed.allreduce import AllReduceSettings, decide


def topo(p2p: list[list[bool]]) -> Topology:
    n = len(p2p)
    return Topology(n, p2p, [0] * n, [32] * n, [2] * n)


def full(n: int) -> Topology:
    return topo([[True] * n for _ in range(n)])


def linked(n: int, pairs: set[tuple[int, int]]) -> Topology:
    """Only the listed pairs (both directions) and each device with itself."""
    return topo(
        [
            [i == j or (i, j) in pairs or (j, i) in pairs for j in range(n)]
            for i in range(n)
        ]
    )


def one_way(n: int) -> Topology:
    """0 reaches 1 but 1 does not reach 0."""
    m = [[True] * n for _ in range(n)]
    m[1][0] = False
    return topo(m)


AUTO = AllReduceSettings()
# A ring 0-1-2-3-0: 0 and 2 are not linked, so the prefix clique is {0, 1}.
RING4 = {(0, 1), (1, 2), (2, 3), (3, 0)}
# Two islands {0,1,2,3} and {4,5,6,7}: a host with two B-Link domains.
ISLANDS8 = {(i, j) for i in range(4) for j in range(4)} | {
    (i, j) for i in range(4, 8) for j in range(4, 8)
}

TABLE = [
    # id, topology, settings, (fused, fused_devices, fp32, host)
    ("one device", full(1), AUTO, (False, 0, False, False)),
    ("2 linked", full(2), AUTO, (True, 2, False, False)),
    ("8 linked", full(8), AUTO, (True, 8, False, False)),
    ("2 without P2P", linked(2, set()), AUTO, (False, 0, False, False)),
    ("8 without P2P", linked(8, set()), AUTO, (False, 0, False, False)),
    ("ring of 4", linked(4, RING4), AUTO, (True, 2, False, False)),
    ("two islands of 4", linked(8, ISLANDS8), AUTO, (True, 4, False, False)),
    ("only 2-3 linked", linked(4, {(2, 3)}), AUTO, (False, 0, False, False)),
    ("one-way link", one_way(4), AUTO, (False, 0, False, False)),
    (
        "override 0 disables",
        full(8),
        AllReduceSettings(fused_devices=0),
        (False, 0, False, False),
    ),
    (
        "override 1 disables",
        full(8),
        AllReduceSettings(fused_devices=1),
        (False, 0, False, False),
    ),
    (
        "override 4 of 8",
        full(8),
        AllReduceSettings(fused_devices=4),
        (True, 4, False, False),
    ),
    (
        "override beats no P2P",
        linked(4, set()),
        AllReduceSettings(fused_devices=4),
        (True, 4, False, False),
    ),
    (
        "override capped",
        full(4),
        AllReduceSettings(fused_devices=16),
        (True, 4, False, False),
    ),
    (
        "fp32 with fused",
        full(8),
        AllReduceSettings(fp32_reduce=True),
        (True, 8, True, False),
    ),
    (
        "fp32 without P2P",
        linked(2, set()),
        AllReduceSettings(fp32_reduce=True),
        (False, 0, True, False),
    ),
    (
        "host reduce wins",
        full(8),
        AllReduceSettings(host_reduce=True),
        (False, 0, False, True),
    ),
    (
        "host reduce beats override",
        full(8),
        AllReduceSettings(fused_devices=8, fp32_reduce=True, host_reduce=True),
        (False, 0, True, True),
    ),
]


@pytest.mark.parametrize(
    ("topology", "settings", "expected"),
    [t[1:] for t in TABLE],
    ids=[t[0] for t in TABLE],
)
def test_decision_table(topology, settings, expected):
    d = decide(topology, settings)
    assert (d.fused, d.fused_devices, d.fp32_reduce, d.host_reduce) == expected
    assert d.reason
    assert d.describe().startswith("SUPA allreduce: ")


def test_decision_is_frozen_and_pure():
    t, s = full(4), AllReduceSettings(fp32_reduce=True)
    d = decide(t, s)
    assert decide(t, s) == d
    with pytest.raises(AttributeError):
        d.fused = False  # type: ignore[misc]


def test_uses_fused_by_group_size():
    d = decide(linked(8, ISLANDS8), AUTO)
    assert [d.uses_fused(n) for n in (1, 2, 4, 8)] == [False, True, True, False]
    off = decide(full(8), AllReduceSettings(host_reduce=True))
    assert not off.uses_fused(2)


def test_reasons_name_the_cause():
    assert (
        "VLLM_BR_USE_CPU_ALL_REDUCE=1"
        in decide(full(2), AllReduceSettings(host_reduce=True)).reason
    )
    assert (
        "VLLM_BR_USE_FUSED_ALLREDUCE=16"
        in decide(full(4), AllReduceSettings(fused_devices=16)).reason
    )
    assert "capped" in decide(full(4), AllReduceSettings(fused_devices=16)).reason
    assert "no P2P link" in decide(linked(2, set()), AUTO).reason
    assert "0..3" in decide(linked(8, ISLANDS8), AUTO).reason
    assert "float32" in decide(full(2), AllReduceSettings(fp32_reduce=True)).describe()


def test_log_says_what_runs():
    """No fused kernel exists: the start-up line never claims one runs."""
    fused = decide(full(8), AUTO).describe()
    assert "on the device collective library" in fused
    assert "none is implemented yet" in fused and "0..7" in fused
    assert "fused over" not in fused
    host = decide(full(8), AllReduceSettings(host_reduce=True)).describe()
    assert host.startswith("SUPA allreduce: on the host (gloo)")


def test_settings_from_env(monkeypatch):
    for name in (
        "VLLM_BR_USE_FUSED_ALLREDUCE",
        "VLLM_BR_USE_FP32_ALL_REDUCE",
        "VLLM_BR_USE_CPU_ALL_REDUCE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert AllReduceSettings.from_env() == AllReduceSettings(None, False, False)
    monkeypatch.setenv("VLLM_BR_USE_FUSED_ALLREDUCE", "2")
    monkeypatch.setenv("VLLM_BR_USE_FP32_ALL_REDUCE", "1")
    monkeypatch.setenv("VLLM_BR_USE_CPU_ALL_REDUCE", "1")
    assert AllReduceSettings.from_env() == AllReduceSettings(2, True, True)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_startup_decision_once_from_device_layer_and_logged(monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_BR_CPU_NUM_DEVICES", "4")
    monkeypatch.setenv("VLLM_BR_USE_FP32_ALL_REDUCE", "1")
    monkeypatch.delenv("VLLM_BR_USE_FUSED_ALLREDUCE", raising=False)
    monkeypatch.delenv("VLLM_BR_USE_CPU_ALL_REDUCE", raising=False)
    records = _Records()
    allreduce.logger.addHandler(records)
    level = allreduce.logger.level
    allreduce.logger.setLevel(logging.INFO)  # vLLM's logging config is not applied here
    allreduce.startup_decision.cache_clear()
    try:
        first = allreduce.startup_decision()
        # decided once: a later change of the environment is not seen
        monkeypatch.setenv("VLLM_BR_USE_CPU_ALL_REDUCE", "1")
        assert allreduce.startup_decision() is first
    finally:
        allreduce.startup_decision.cache_clear()
        allreduce.logger.removeHandler(records)
        allreduce.logger.setLevel(level)
    # the cpu backend emulates fully P2P-connected cards
    assert (first.fused, first.fused_devices, first.fp32_reduce, first.host_reduce) == (
        True,
        4,
        True,
        False,
    )
    assert records.messages == [first.describe()]

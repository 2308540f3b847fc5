"""The pybrml stand-in (tests/standin/python/pybrml): the topology described
by SUPA_STANDIN_TOPOLOGY reaches vllm_br.device.brml as BRML would report it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_br.device import brml

STANDIN_PYTHON = Path(__file__).resolve().parents[1] / "standin" / "python"
_MISSING = object()


@pytest.fixture
def pybrml(monkeypatch):
    """The stand-in, imported from tests/standin/python; sys.path and
    sys.modules are as before afterwards."""
    monkeypatch.delenv("SUPA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SUPA_STANDIN_TOPOLOGY", raising=False)
    saved = sys.modules.pop("pybrml", _MISSING)
    sys.path.insert(0, str(STANDIN_PYTHON))
    try:
        import pybrml

        assert Path(pybrml.__file__).parent.parent == STANDIN_PYTHON
        yield pybrml
        assert pybrml.init_count() == 0  # every brmlInit was shut down
    finally:
        sys.path.remove(str(STANDIN_PYTHON))
        if saved is _MISSING:
            sys.modules.pop("pybrml", None)
        else:
            sys.modules["pybrml"] = saved


def test_two_cards_two_dies_with_p2p(pybrml, monkeypatch):
    monkeypatch.setenv(
        "SUPA_STANDIN_TOPOLOGY",
        '{"cards": 2, "dies_per_card": 2, "p2p": true, "memory_gib": 4}',
    )
    links = brml._query_brml(pybrml, 2)
    assert links.source == "brml"
    assert links.p2p == [[True, True], [True, True]]
    assert links.numa_nodes == [0, 1]
    d0, d1 = links.devices
    assert (d0.index, d0.physical_index, d1.physical_index) == (0, 0, 1)
    assert d0.uuid.startswith("SUPA-STANDIN-0000-") and d0.uuid != d1.uuid
    assert (d0.pci_bus_id, d1.pci_bus_id) == ("0000:10:00.0", "0000:11:00.0")
    assert d0.memory_total == d1.memory_total == 4 << 30
    topo = pybrml.topology()
    assert (topo.cards, topo.dies_per_card, topo.spc_per_card) == (2, 2, 32)
    assert brml.dies_for(topo.spc_per_card) == 2  # the torch stand-in's SPCs


def test_two_cards_without_p2p(pybrml, monkeypatch):
    monkeypatch.setenv(
        "SUPA_STANDIN_TOPOLOGY", '{"cards": 2, "dies_per_card": 2, "p2p": false}'
    )
    links = brml._query_brml(pybrml, 2)
    assert links.p2p == [[True, False], [False, True]]  # a card reaches itself
    assert links.numa_nodes == [0, 1]
    pybrml.brmlInit()
    h0, h1 = (pybrml.brmlDeviceGetHandleByIndex(i) for i in (0, 1))
    status = pybrml.brmlDeviceGetP2PStatus(h0, h1, pybrml.BRML_P2P_CAPS_INDEX_READ)
    assert status == pybrml.BRML_P2P_STATUS_NOT_SUPPORTED != pybrml.BRML_P2P_STATUS_OK
    pybrml.brmlShutdown()


def test_defaults_and_visible_devices(pybrml, monkeypatch):
    links = brml._query_brml(pybrml, 8)
    assert links.numa_nodes == [0, 0, 0, 0, 1, 1, 1, 1]  # halves
    assert all(all(row) for row in links.p2p)
    assert {d.memory_total for d in links.devices} == {4 << 30}
    topo = pybrml.topology()
    assert (topo.cards, topo.dies_per_card, topo.spc_per_card) == (8, 1, 16)
    # BRML numbers physical cards: visible device N is card SUPA_VISIBLE_DEVICES[N]
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "6,1")
    links = brml._query_brml(pybrml, 2)
    assert links.numa_nodes == [1, 0]
    assert [d.physical_index for d in links.devices] == [6, 1]
    assert links.devices[0].uuid == "SUPA-STANDIN-0006-0000-0000-000000000006"
    monkeypatch.setenv("SUPA_STANDIN_TOPOLOGY", '{"cards": 4}')
    with pytest.raises(RuntimeError, match="names cards"):
        brml._query_brml(pybrml, 2)  # card 6 of 4


def test_init_balance(pybrml):
    assert pybrml.__version__ == "0.0.0+standin"
    with pytest.raises(pybrml.BRMLError_Uninitialized):
        pybrml.brmlDeviceGetCount()
    with pytest.raises(pybrml.BRMLError_Uninitialized):
        pybrml.brmlShutdown()
    pybrml.brmlInit()
    pybrml.brmlInit()
    h = pybrml.brmlDeviceGetHandleByIndex(3)
    pybrml.brmlShutdown()
    assert pybrml.brmlDeviceGetNumaNode(h) == 0  # still initialised once
    pybrml.brmlShutdown()
    with pytest.raises(pybrml.BRMLError_Uninitialized, match="before brmlInit"):
        pybrml.brmlDeviceGetMemoryInfo(h)
    pybrml.brmlInit()
    with pytest.raises(pybrml.BRMLError_InvalidArgument, match="no card 8"):
        pybrml.brmlDeviceGetHandleByIndex(8)
    pybrml.brmlShutdown()


@pytest.mark.parametrize(
    "raw, match",
    [
        ("{not json", "not valid JSON"),
        ('{"cards": 2, "die": 2}', r"unknown keys \['die'\]"),
        ('{"cards": 0}', "cards must be at least 1"),
        ('{"dies_per_card": 3}', "dies_per_card must be 1 or 2"),
        ('{"p2p": "yes"}', "p2p must be true or false"),
        ('{"memory_gib": 0}', "memory_gib must be positive"),
        ("[2]", "must be a JSON object"),
    ],
)
def test_bad_descriptions(pybrml, raw, match):
    with pytest.raises(ValueError, match=f"SUPA_STANDIN_TOPOLOGY.*{match}"):
        pybrml.topology(raw)


def test_description_from_a_file(pybrml, tmp_path):
    path = tmp_path / "topology.json"
    path.write_text('{"cards": 3, "numa_nodes": 3, "memory_gib": 0.5}')
    topo = pybrml.topology(str(path))
    assert [topo.numa_node(i) for i in range(3)] == [0, 1, 2]
    assert topo.memory_bytes == 1 << 29

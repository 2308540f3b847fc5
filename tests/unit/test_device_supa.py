"""The supa backend against the fake torch_br/pybrml (no card exists here)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # plain `pytest` does not put the repo root there
    sys.path.insert(0, str(_ROOT))

from tests.fakes import installed_fake_torch_br  # noqa: E402
from vllm_br import device as device_layer  # noqa: E402
from vllm_br.device.base import Topology  # noqa: E402
from vllm_br.errors import SUPAConfigError  # noqa: E402

_ENV = (
    "VLLM_BR_DEVICE",
    "VLLM_BR_DEVICE_SPC_NUM",
    "SUPA_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake():
    with installed_fake_torch_br() as stack:
        yield stack


@pytest.fixture
def backend(fake):
    from vllm_br.device.supa import SupaBackend

    return SupaBackend()


def test_identity(backend):
    assert backend.name == "supa"
    assert backend.torch_device_type == "supa"
    assert backend.dist_backend == "sccl"
    assert backend.dispatch_key == "PrivateUse1"


def test_get_backend_selects_supa(fake, monkeypatch):
    from vllm_br.device.supa import SupaBackend

    monkeypatch.setenv("VLLM_BR_DEVICE", "supa")
    b = device_layer.get_backend()
    assert isinstance(b, SupaBackend)
    assert device_layer.get_backend() is b


def test_device_count_and_set_device(backend, fake):
    assert backend.device_count() == 2
    assert backend.current_device() == 0
    backend.set_device(1)
    assert backend.current_device() == 1
    assert fake.state.current == 1


def test_set_device_out_of_range(backend):
    with pytest.raises(
        SUPAConfigError, match=r"supa:2 does not exist.*SUPA_VISIBLE_DEVICES"
    ):
        backend.set_device(2)


def test_synchronize_and_seed_delegate(backend, fake):
    backend.synchronize()
    backend.synchronize(1)
    assert fake.state.synchronized == [None, 1]
    backend.manual_seed_all(7)
    assert fake.state.seeds == [7]
    assert backend.is_bf16_supported() is True


def test_device_properties():
    from vllm_br.device.supa import SupaBackend

    with installed_fake_torch_br(spc=32, numa=[3, 5], total=64 << 30):
        props = SupaBackend().get_device_properties(1)
    assert props.name == "Biren BR100 (fake)"
    assert props.total_memory == 64 << 30
    assert props.spc_count == 32
    assert props.numa_node == 5


def test_memory():
    from vllm_br.device.supa import SupaBackend

    with installed_fake_torch_br(free=3 << 30, total=8 << 30) as stack:
        b = SupaBackend()
        assert b.mem_get_info() == (3 << 30, 8 << 30)
        assert b.mem_get_info(1) == (3 << 30, 8 << 30)
        stack.state.allocated = stack.state.peak = 100
        assert b.memory_allocated() == 100
        assert b.max_memory_allocated() == 100
        stack.state.allocated = 40
        b.reset_peak_memory_stats()
        assert b.max_memory_allocated() == 40
        assert b.memory_stats()["allocated_bytes.all.current"] == 40
        b.empty_cache()
        assert stack.state.empty_cache_calls == 1


def test_topology_from_brml():
    from vllm_br.device.supa import SupaBackend

    p2p = [
        [True, True, False, False],
        [True, True, False, False],
        [False, False, True, True],
        [False, False, True, True],
    ]
    with installed_fake_torch_br(
        device_count=4, spc=32, p2p=p2p, numa=[0, 0, 1, 1]
    ) as s:
        b = SupaBackend()
        topo = b.topology()
        assert s.pybrml.initialized == 0  # every brmlInit has its brmlShutdown
        devices = b.devices()
    assert isinstance(topo, Topology)
    assert topo.device_count == 4
    assert topo.p2p == p2p
    assert topo.numa_nodes == [0, 0, 1, 1]
    assert topo.spc_counts == [32] * 4
    assert topo.dies_per_device == [2] * 4
    assert [d.uuid for d in devices] == [f"BR-fake-{i}" for i in range(4)]
    assert devices[0].memory_total == 64 << 30


def test_topology_maps_visible_devices_to_brml(monkeypatch):
    """torch_br applies SUPA_VISIBLE_DEVICES; BRML numbers physical cards."""
    from vllm_br.device import brml

    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "2,3")
    with installed_fake_torch_br(device_count=4, numa=[0, 0, 1, 1]) as s:
        s.state.device_count = 2  # what torch_br sees after SUPA_VISIBLE_DEVICES
        s.state.p2p = [[True] * 4 for _ in range(4)]
        # pybrml still sees 4 physical cards
        s.pybrml.brmlDeviceGetCount = lambda: 4
        s.pybrml.brmlDeviceGetHandleByIndex = lambda i: 1000 + i
        links = brml.query_links(s.supa)
    assert links.numa_nodes == [1, 1]
    assert [d.physical_index for d in links.devices] == [2, 3]


def test_spc_override_and_dies(backend, monkeypatch):
    assert backend.topology().dies_per_device == [2, 2]
    monkeypatch.setenv("VLLM_BR_DEVICE_SPC_NUM", "16")
    topo = backend.topology()
    assert topo.spc_counts == [16, 16]
    assert topo.dies_per_device == [1, 1]
    assert backend.get_device_properties(0).spc_count == 16
    monkeypatch.setenv("VLLM_BR_DEVICE_SPC_NUM", "17")
    assert backend.topology().dies_per_device == [2, 2]


def test_single_die_card():
    from vllm_br.device.supa import SupaBackend

    with installed_fake_torch_br(spc=16):
        topo = SupaBackend().topology()
    assert topo.spc_counts == [16, 16]
    assert topo.dies_per_device == [1, 1]


def test_topology_without_pybrml():
    from vllm_br.device.supa import SupaBackend

    p2p = [[True, False], [False, True]]
    with installed_fake_torch_br(p2p=p2p, with_pybrml=False):
        b = SupaBackend()
        topo = b.topology()
        versions = b.versions()
    assert topo.p2p == p2p
    assert topo.numa_nodes == [-1, -1]
    assert versions["pybrml"] is None


def test_streams_and_events_delegate(backend, fake):
    s = backend.Stream(priority=-1)
    assert type(s).__name__ == "FakeStream" and s.priority == -1
    e = backend.Event(enable_timing=True)
    assert type(e).__name__ == "FakeEvent" and e.enable_timing
    default = backend.current_stream()
    assert default is fake.state.default_stream
    with backend.stream(s):
        assert backend.current_stream() is s
    assert backend.current_stream() is default


def test_capture_graph(backend, fake):
    calls = []
    x = torch.arange(4.0)

    def fn(t):
        calls.append(backend.is_current_stream_capturing())
        return t * 2

    pool = backend.graph_pool_handle()
    g = backend.capture_graph(fn, x, pool=pool)
    # warm-up (not capturing) on a side stream, then the capture itself
    assert calls == [False, True]
    assert g.graph.captured and g.graph.pool is pool
    assert not backend.is_current_stream_capturing()
    assert torch.equal(g.output, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    out = g.output
    # the fake graph does not recompute: replay() only reaches SUPAGraph.replay
    assert g.replay() is out
    assert g.replay() is out
    assert g.graph.replays == 2
    assert len(calls) == 2


def test_versions(backend):
    assert backend.versions() == {"torch_br": "0.0.0+fake", "pybrml": "0.0.0+fake"}


def test_fused_kernels_empty(backend):
    assert backend.fused_kernels() == {}


def test_missing_torch_br_error(monkeypatch):
    from vllm_br.device.supa import SupaBackend

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "torch_br":
            raise ModuleNotFoundError("No module named 'torch_br'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    monkeypatch.setenv("VLLM_BR_DEVICE", "supa")
    with pytest.raises(SUPAConfigError) as info:
        SupaBackend()
    msg = str(info.value)
    assert msg == (
        "VLLM_BR_DEVICE=supa but torch_br cannot be imported (No module named "
        "'torch_br'); install the Biren torch_br package or set "
        "VLLM_BR_DEVICE=cpu to use the host emulation."
    )
    assert msg.count(".") == 1 and msg.endswith(".")


def test_missing_torch_br_via_get_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_br", None)  # import raises ImportError
    monkeypatch.setenv("VLLM_BR_DEVICE", "supa")
    device_layer._make_backend.cache_clear()
    try:
        with pytest.raises(SUPAConfigError, match=r"^VLLM_BR_DEVICE=supa but torch_br"):
            device_layer.get_backend()
    finally:
        device_layer._make_backend.cache_clear()


def test_auto_with_a_card_but_no_torch_br_stops_with_one_sentence(
    monkeypatch, tmp_path
):
    """A card's device node exists but torch_br fails to import: auto must not
    fall back to the emulation silently."""
    (tmp_path / "card0").touch()
    monkeypatch.setattr(device_layer, "CARD_NODES", str(tmp_path / "card*"))
    monkeypatch.setitem(sys.modules, "torch_br", None)  # import raises ImportError
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    assert device_layer.supa_present()
    with pytest.raises(SUPAConfigError) as info:
        device_layer.backend_name()
    msg = str(info.value)
    assert msg == (
        f"VLLM_BR_DEVICE=auto found a SUPA card ({tmp_path / 'card0'}) but "
        "torch_br cannot be imported (import of torch_br halted; None in "
        "sys.modules); install the Biren torch_br package built for this torch, "
        "or set VLLM_BR_DEVICE=cpu to emulate SUPA on the host."
    )
    assert msg.count(". ") == 0 and msg.endswith(".")
    # The platform stops start-up with the same sentence.
    from vllm_br import platform as supa_platform

    with pytest.raises(SUPAConfigError, match=r"^VLLM_BR_DEVICE=auto found a SUPA"):
        supa_platform.SUPAPlatform.check_and_update_config(None)
    # No card node: auto is the emulation, and torch_br is not looked at.
    monkeypatch.setattr(device_layer, "CARD_NODES", str(tmp_path / "none*"))
    assert device_layer.backend_name() == "cpu"


def test_auto_with_a_card_and_torch_br_is_supa(monkeypatch, tmp_path):
    (tmp_path / "card0").touch()
    monkeypatch.setattr(device_layer, "CARD_NODES", str(tmp_path / "card*"))
    monkeypatch.setenv("VLLM_BR_DEVICE", "auto")
    with installed_fake_torch_br():
        assert device_layer.backend_name() == "supa"


def test_fake_is_removed_cleanly():
    had_supa = hasattr(torch, "supa")
    before = {k: sys.modules.get(k) for k in ("torch_br", "pybrml")}
    with installed_fake_torch_br():
        assert "torch_br" in sys.modules and hasattr(torch, "supa")
    assert hasattr(torch, "supa") == had_supa
    assert {k: sys.modules.get(k) for k in ("torch_br", "pybrml")} == before


def test_import_does_not_load_vendor_stack(tmp_path):
    # A torch_br that find_spec can see but that must never be executed.
    pkg = tmp_path / "torch_br"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('torch_br was imported')\n")
    (tmp_path / "pybrml.py").write_text("raise RuntimeError('pybrml was imported')\n")
    code = textwrap.dedent(
        """
        import sys
        import vllm_br
        import vllm_br.device
        name = vllm_br.device.backend_name()
        assert name in ("cpu", "supa"), name
        bad = [m for m in ("torch_br", "pybrml") if m in sys.modules]
        assert not bad, bad
        print("ok", name)
        """
    )
    env = dict(os.environ, VLLM_BR_DEVICE="auto", PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")

"""The cpu backend: SUPA devices emulated on the host."""

from __future__ import annotations

import mmap
import re
import time

import psutil
import pytest
import torch

from vllm_br.device.base import Topology
from vllm_br.device.cpu import CpuBackend, EmulatedGraphPool
from vllm_br.errors import SUPAConfigError

MB = 1 << 20


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (
        "VLLM_BR_CPU_NUM_DEVICES",
        "VLLM_BR_CPU_MEMORY_GIB",
        "VLLM_BR_DEVICE_SPC_NUM",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def backend():
    return CpuBackend()


def test_identity(backend):
    assert backend.name == "cpu"
    assert backend.torch_device_type == "cpu"
    assert backend.dist_backend == "gloo"
    assert backend.torch_device(3) == torch.device("cpu")


def test_device_count(backend, monkeypatch):
    assert backend.device_count() == 8
    monkeypatch.setenv("VLLM_BR_CPU_NUM_DEVICES", "3")
    assert backend.device_count() == 3


def test_set_device(backend, monkeypatch):
    monkeypatch.setenv("VLLM_BR_CPU_NUM_DEVICES", "2")
    backend.set_device(1)
    assert backend.current_device() == 1
    for bad in (2, -1):
        with pytest.raises(SUPAConfigError) as info:
            backend.set_device(bad)
        msg = str(info.value)
        assert "VLLM_BR_CPU_NUM_DEVICES=2" in msg
        assert f"supa:{bad}" in msg
        assert msg.endswith(".") and not re.search(r"\.\s", msg)
    assert backend.current_device() == 1


def test_mem_get_info(backend, monkeypatch):
    host = psutil.virtual_memory().total
    free, total = backend.mem_get_info()
    assert 0 <= free <= total
    assert total == min(4 << 30, host)
    monkeypatch.setenv("VLLM_BR_CPU_MEMORY_GIB", "0.5")
    free, total = backend.mem_get_info()
    assert total == min(512 * MB, host)
    assert 0 <= free <= total
    monkeypatch.setenv("VLLM_BR_CPU_MEMORY_GIB", "100000")
    assert backend.mem_get_info()[1] == host
    assert backend.get_device_properties().total_memory == host


def _fresh_tensor(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A tensor on pages the process never had, every page touched. A plain
    torch allocation may reuse freed heap memory that is still resident (the
    cpu backend keeps freed memory mapped, and the engines of earlier tests
    in this process leave plenty), so the resident size would not grow."""
    buf = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(1)
    return t, buf


def test_memory_allocated_tracks_a_tensor(backend):
    before = backend.memory_allocated()
    t, buf = _fresh_tensor(200 * MB)
    grown = backend.memory_allocated() - before
    assert 150 * MB <= grown <= 260 * MB, grown / MB
    stats = backend.memory_stats()
    assert stats["allocated_bytes.all.current"] >= before + 150 * MB
    del t
    buf.close()


def test_max_memory_allocated_after_reset(backend):
    backend.reset_peak_memory_stats()
    base = backend.memory_allocated()
    assert backend.max_memory_allocated() >= base - 16 * MB
    t, buf = _fresh_tensor(200 * MB)
    assert backend.max_memory_allocated() >= base + 150 * MB
    assert backend.max_memory_allocated() >= backend.memory_allocated() - 16 * MB
    del t
    buf.close()


def test_events_elapsed_time(backend):
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    with pytest.raises(RuntimeError):
        start.elapsed_time(end)
    start.record()
    time.sleep(0.02)
    end.record(backend.current_stream())
    end.synchronize()
    assert end.query()
    ms = start.elapsed_time(end)
    assert 15.0 <= ms < 2000.0


def test_streams(backend):
    s = backend.Stream()
    with backend.stream(s):
        assert backend.current_stream() == s
    e = s.record_event()
    assert e.query()
    assert not backend.is_current_stream_capturing()


def test_graph_replay_sees_copied_inputs(backend):
    static_in = torch.zeros(4)

    def fn(x):
        return x * 2 + 1

    g = backend.capture_graph(fn, static_in)
    static_out = g.output
    assert torch.equal(static_out, torch.ones(4))

    static_in.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    result = g.replay()
    assert result is static_out  # written into the same static buffer
    assert torch.equal(result, torch.tensor([3.0, 5.0, 7.0, 9.0]))


def test_graph_stale_input_bug_is_detectable(backend):
    static_in = torch.zeros(4)
    g = backend.capture_graph(lambda x: x * 2 + 1, static_in)
    new_input = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # Forgetting to copy into the static buffer: replay sees the old input.
    stale = g.replay()
    assert torch.equal(stale, torch.ones(4))
    assert not torch.equal(stale, new_input * 2 + 1)
    static_in.copy_(new_input)
    assert torch.equal(g.replay(), new_input * 2 + 1)


def test_graph_pool_is_shared(backend):
    pool = backend.graph_pool_handle()
    assert isinstance(pool, EmulatedGraphPool)
    x = torch.ones(2)
    g1 = backend.capture_graph(lambda t: t + 1, x, pool=pool)
    g2 = backend.capture_graph(lambda t: t * 3, x, pool=pool)
    assert pool.graphs == [g1, g2]
    assert g1.pool is pool and g2.pool is pool
    other = backend.graph_pool_handle()
    g3 = backend.capture_graph(lambda t: t, x, pool=other)
    assert other.graphs == [g3] and g3 not in pool.graphs


def test_graph_tuple_outputs(backend):
    x = torch.zeros(3)
    g = backend.capture_graph(lambda t: (t + 1, t - 1), x)
    a, b = g.output
    x.fill_(5.0)
    out = g.replay()
    assert out[0] is a and out[1] is b
    assert torch.equal(a, torch.full((3,), 6.0))
    assert torch.equal(b, torch.full((3,), 4.0))


def test_topology_shape(backend, monkeypatch):
    monkeypatch.setenv("VLLM_BR_CPU_NUM_DEVICES", "4")
    topo = backend.topology()
    assert isinstance(topo, Topology)
    assert topo.device_count == 4
    assert len(topo.p2p) == 4 and all(len(row) == 4 for row in topo.p2p)
    assert len(topo.numa_nodes) == 4
    assert topo.spc_counts == [32] * 4
    assert topo.dies_per_device == [2] * 4
    monkeypatch.setenv("VLLM_BR_DEVICE_SPC_NUM", "16")
    topo = backend.topology()
    assert topo.spc_counts == [16] * 4
    assert topo.dies_per_device == [1] * 4


def test_versions_and_kernels(backend):
    assert backend.versions() == {"torch_br": None}
    from vllm_br.device.cpu_kernels import packed_linear

    # The C++ host kernels (tests/unit/test_paged_attention.py checks them),
    # greedy sampling (tests/unit/test_sampling.py) and, on hosts with fast
    # bf16, the packed GEMMs (tests/unit/test_packed_linear.py); int8 GEMMs
    # on torch._int_mm / _weight_int8pack_mm (tests/unit/test_quant_ops.py).
    expect = {
        "int8_scaled_mm",
        "weight_only_linear",
        "paged_attention_decode",
        "paged_attention_prefill",
        "reshape_and_cache",
        "greedy_sample",
        "linear",
        "compute_logits",
    }
    if packed_linear.host_supported():
        expect |= {"prepare_gemm_weight"}
    assert set(backend.fused_kernels()) == expect


@pytest.mark.parametrize(
    "env,avx512_bf16,amx,expect",
    [
        ("fp32", True, True, torch.float32),
        ("native", False, False, torch.bfloat16),
        ("auto", False, False, torch.float32),
        ("auto", True, False, torch.bfloat16),
        ("auto", False, True, torch.bfloat16),
    ],
)
def test_bf16_matmul_policy(backend, monkeypatch, env, avx512_bf16, amx, expect):
    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", env)
    from vllm_br.device import cpu_isa

    isa = cpu_isa.HostISA(avx512=True, avx512_bf16=avx512_bf16, amx_bf16=amx)
    monkeypatch.setattr(cpu_isa, "host_isa", lambda: isa)
    assert backend.matmul_dtype(torch.bfloat16) == expect
    assert backend.matmul_dtype(torch.float32) == torch.float32


def test_set_device_keeps_freed_host_memory():
    """After set_device, glibc keeps a freed 24 MB block mapped for the next
    step's activations (as a device's caching allocator would); by default a
    fresh process maps such a block for the request and unmaps it on free."""
    import subprocess
    import sys

    code = """
import ctypes, psutil
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
proc = psutil.Process()
def released(n=24 << 20):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    held = proc.memory_info().rss
    libc.free(p)
    return held - proc.memory_info().rss
before = released()
from vllm_br.device.cpu import CpuBackend, keep_freed_host_memory
CpuBackend().set_device(0)
assert keep_freed_host_memory()
print(before, released())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    before, after = (int(v) for v in out[-2:])
    assert before > 16 << 20, before
    assert after < 4 << 20, after

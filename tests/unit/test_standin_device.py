"""The stand-in SUPA device behaves like a device, not like the host.

In a session on another device this module holds one test, which runs the
module again in a nested pytest session on the stand-in (see
tests/fixtures/standin.py); the device cannot be registered next to the
fakes of the unit tests in one process.
"""

from __future__ import annotations

import pytest

from tests.fixtures import standin

if not standin.active():

    def test_on_the_standin_device(tmp_path):
        """This module's tests, in a pytest session on the stand-in."""
        standin.run_nested(__file__, tmp_path, min_tests=14)

    @pytest.mark.slow
    def test_on_the_standin_device_slow(tmp_path):
        """This module's slow tests (`vllm-br check`), on the stand-in."""
        standin.run_nested(__file__, tmp_path, min_tests=1, markers="slow")

else:
    import torch
    import torch_br  # noqa: F401  (registers the device, as on a card)

    MiB = 1 << 20

    def test_supa_is_its_own_device():
        x = torch.empty(4, device="supa:0")
        assert x.device == torch.device("supa", 0)
        assert x.is_supa and not x.is_cpu
        assert torch.supa.device_count() == 2  # the test topology: two cards
        assert torch.accelerator.current_accelerator().type == "supa"

    def test_an_op_mixing_supa_and_cpu_raises():
        a = torch.ones(3, device="supa")
        with pytest.raises(RuntimeError, match="same device.*supa:0 and cpu"):
            a + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([a, torch.ones(3)])
        with pytest.raises(RuntimeError, match="same device.*supa:1"):
            a + torch.ones(3, device="supa:1")
        # A 0-dim CPU tensor is a scalar operand, which a card takes too.
        assert (a + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]

    def test_results_equal_the_cpu_kernels_and_stay_on_the_device():
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(33, 17, generator=g), torch.randn(17, 9, generator=g)
        for op in (
            lambda x, y: x @ y,
            lambda x, y: torch.softmax(x @ y, dim=-1),
            lambda x, y: (x[:9, :9] * 2 - y[:9]).sum(0),
        ):
            got = op(a.to("supa"), b.to("supa"))
            assert got.device.type == "supa"
            assert torch.equal(got.cpu(), op(a, b))
        before = torch.supa.standin_counts().get("op.aten::mm", 0)
        a.to("supa") @ b.to("supa")
        assert torch.supa.standin_counts()["op.aten::mm"] == before + 1

    def test_views_share_device_memory():
        x = torch.zeros(4, 6, device="supa")
        x.view(24)[3] = 5.0
        x.t()[1, 2] = 7.0
        x[:, 4:].unfold(0, 2, 1)[0, 0, 0] = 9.0
        expected = torch.zeros(4, 6)
        expected.view(24)[3], expected[2, 1], expected[0, 4] = 5.0, 7.0, 9.0
        assert torch.equal(x.cpu(), expected)

    def test_memory_statistics_move_with_allocations():
        base = torch.supa.memory_allocated(0)
        free_before, total = torch.supa.mem_get_info(0)
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="supa:0")
        assert torch.supa.memory_allocated(0) - base >= 64 * MiB
        assert torch.supa.max_memory_allocated(0) - base >= 64 * MiB
        free_during, _ = torch.supa.mem_get_info(0)
        assert free_before - free_during >= 64 * MiB
        stats = torch.supa.memory_stats(0)
        assert stats["allocated_bytes.all.current"] == torch.supa.memory_allocated(0)
        # The same numbers through torch.accelerator (the DeviceAllocator API).
        assert torch.accelerator.memory_allocated(0) == torch.supa.memory_allocated(0)
        del x
        assert torch.supa.memory_allocated(0) == base
        assert torch.supa.mem_get_info(0) == (free_before, total)
        # Device 1 keeps its own account.
        with torch.supa.device(1):
            y = torch.empty(MiB, dtype=torch.uint8, device="supa")
        assert y.device.index == 1
        assert torch.supa.memory_allocated(1) >= MiB
        assert torch.supa.memory_allocated(0) == base

    def test_out_of_memory_is_real():
        _, total = torch.supa.mem_get_info(0)
        ooms = torch.supa.memory_stats(0)["num_ooms"]
        with pytest.raises(torch.OutOfMemoryError, match="SUPA out of memory"):
            torch.empty(total + MiB, dtype=torch.uint8, device="supa:0")
        assert torch.supa.memory_stats(0)["num_ooms"] == ooms + 1
        assert total == torch.supa.get_device_properties(0).total_memory

    def test_copies_cross_through_the_copy_kernel():
        torch.supa.reset_standin_counts()
        host = torch.arange(10.0)
        dev = host.to("supa")
        back = dev.cpu()
        pinned = torch.empty(10).pin_memory()
        assert pinned.is_pinned() and not host.is_pinned()
        dev.copy_(pinned.fill_(3.0), non_blocking=True)
        counts = torch.supa.standin_counts()
        assert counts["copy.h2d"] == 2 and counts["copy.d2h"] == 1
        assert counts["copy.h2d_bytes"] == 80
        assert counts["copy.h2d_pinned_non_blocking"] == 1
        assert torch.equal(back, host) and dev.cpu().tolist() == [3.0] * 10
        assert torch.zeros(2, pin_memory=True).is_pinned()

    def test_generators_are_per_device_and_seeded():
        torch.supa.manual_seed_all(7)
        a = torch.randn(5, device="supa:0").cpu()
        torch.supa.manual_seed_all(7)
        assert torch.equal(torch.randn(5, device="supa:0").cpu(), a)
        g = torch.Generator(device="supa")
        assert g.device.type == "supa"
        g.manual_seed(3)
        u = torch.empty(4, device="supa").uniform_(generator=g).cpu()
        g.manual_seed(3)
        assert torch.equal(torch.empty(4, device="supa").uniform_(generator=g).cpu(), u)

    def test_streams_and_events():
        s = torch.supa.Stream()
        assert isinstance(s, torch.supa.Stream) and s.supa_stream != 0
        assert torch.supa.current_stream().supa_stream == 0
        with torch.supa.stream(s):
            assert torch.supa.current_stream().supa_stream == s.supa_stream
        assert torch.supa.current_stream().supa_stream == 0
        s.wait_stream(torch.supa.current_stream())
        start, end = (
            torch.supa.Event(enable_timing=True),
            torch.supa.Event(enable_timing=True),
        )
        start.record()
        torch.ones(100, device="supa").sum()
        end.record()
        end.synchronize()
        assert end.query() and start.elapsed_time(end) >= 0.0

    def test_graph_replay_reads_the_captured_buffers():
        static_in = torch.ones(4, device="supa")
        weight = torch.full((4,), 2.0, device="supa")
        graph = torch.supa.SUPAGraph()
        captures = torch_br.graphs.stats["captures"]
        with torch.supa.graph(graph, pool=torch.supa.graph_pool_handle()):
            assert torch.supa.is_current_stream_capturing()
            static_out = (static_in * weight + 1).sum()
        assert not torch.supa.is_current_stream_capturing()
        assert torch_br.graphs.stats["captures"] == captures + 1
        assert static_out.item() == 12.0
        static_in.copy_(torch.arange(4.0))
        weight.fill_(3.0)
        graph.replay()
        assert static_out.item() == 22.0  # (0+1+2+3)*3 + 4, in the same buffer

    def test_a_graph_holds_its_outputs_not_its_intermediates():
        """As in a graph pool: what the capture dropped is freed, and a replay
        makes its intermediates again without growing the memory held."""
        x = torch.ones(1 << 20, device="supa")  # 4 MiB
        base = torch.supa.memory_allocated()
        graph = torch.supa.SUPAGraph()
        with torch.supa.graph(graph):
            y = ((x * 2) + 1) * 3  # two 4 MiB intermediates
        held = torch.supa.memory_allocated() - base
        assert 4 * MiB <= held < 5 * MiB  # y only
        x.fill_(2.0)
        graph.replay()
        assert y[0].item() == 15.0
        assert torch.supa.memory_allocated() - base == held

    def test_a_host_sync_inside_a_capture_raises():
        x = torch.ones(2, device="supa")
        graph = torch.supa.SUPAGraph()
        with pytest.raises(
            RuntimeError, match="not permitted when stream is capturing"
        ):
            with torch.supa.graph(graph):
                x.sum().item()
        assert not torch.supa.is_current_stream_capturing()

    def test_bf16_and_properties_follow_the_topology():
        assert torch.supa.is_bf16_supported()
        props = torch.supa.get_device_properties(0)
        assert props.multi_processor_count == 32  # two dies of 16 SPCs
        assert torch.supa.can_device_access_peer(0, 1)

    def test_supa_backend_reads_the_standin_topology():
        from vllm_br.device.supa import SupaBackend

        backend = SupaBackend()
        topo = backend.topology()
        assert topo.device_count == 2
        assert topo.dies_per_device == [2, 2]
        assert topo.p2p == [[True, True], [True, True]]
        assert backend.versions()["torch_br"] == "0.0.0+standin"
        assert backend.versions()["pybrml"] == "0.0.0+standin"
        assert [d.uuid for d in backend.devices()][0].startswith("SUPA-STANDIN-")

    def test_bfloat16_matmul_matches_the_cpu():
        g = torch.Generator().manual_seed(1)
        a = torch.randn(16, 32, generator=g, dtype=torch.bfloat16)
        b = torch.randn(32, 8, generator=g, dtype=torch.bfloat16)
        assert torch.equal((a.to("supa") @ b.to("supa")).cpu(), a @ b)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_sdpa_takes_the_fused_kernel_and_matches_the_formula(dtype):
        """SDPA on supa runs one fused kernel, as torch_br's on a card, not
        the math path op by op; with an additive mask it equals the plain
        formula (float32 1e-5, bfloat16 2e-2: one rounding of the output)."""
        import torch.nn.functional as F

        g = torch.Generator().manual_seed(2)
        q = torch.randn(2, 3, 130, 64, generator=g)
        k = torch.randn(2, 3, 140, 64, generator=g)
        v = torch.randn(2, 3, 140, 64, generator=g)
        bias = torch.zeros(2, 1, 130, 140)
        bias[0, ..., 100:] = float("-inf")
        ref = torch.softmax(q @ k.transpose(-1, -2) * 0.125 + bias, -1) @ v
        before = torch.supa.standin_counts()
        got = F.scaled_dot_product_attention(
            *(t.to(dtype).to("supa") for t in (q, k, v)),
            attn_mask=bias.to(dtype).to("supa"),
            scale=0.125,
        )
        after = torch.supa.standin_counts()
        assert got.device.type == "supa" and got.dtype == dtype
        assert after.get("sdpa.fused", 0) == before.get("sdpa.fused", 0) + 1
        assert after.get("op.aten::bmm", 0) == before.get("op.aten::bmm", 0)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), ref, atol=tol, rtol=tol)

    def test_device_kernels_use_the_device_threads_not_the_hosts():
        """vLLM drops torch to one host thread for serving; the stand-in's
        kernels keep the device's own, and the host's setting is untouched."""
        import os

        env = os.environ.get("SUPA_STANDIN_THREADS") or os.environ.get(
            "OMP_NUM_THREADS"
        )
        expected = int(env) if env else len(os.sched_getaffinity(0))
        assert torch.supa.standin_device_threads() == expected
        host = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.supa.standin_kernel_threads() == expected
            assert torch.get_num_threads() == 1
        finally:
            torch.set_num_threads(host)

    @pytest.mark.slow
    def test_vllm_br_check_passes_on_the_standin():
        """`vllm-br check --json` on the stand-in: every check passes, memory
        accounting included (the stand-in's allocator tracks it)."""
        import json
        import os
        import subprocess
        import sys
        from pathlib import Path

        cli = Path(sys.executable).with_name("vllm-br")
        proc = subprocess.run(
            [str(cli), "check", "--json"],
            env=dict(os.environ),
            cwd=standin.ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        results = json.loads(proc.stdout)
        bad = [r for r in results if r["status"] != "PASS"]
        assert not bad, json.dumps(bad, indent=1) + proc.stderr[-3000:]
        assert proc.returncode == 0
        groups = {r["group"] for r in results}
        assert groups == {"ops", "attention", "graphs", "memory", "collectives", "e2e"}
        init = next(
            r for r in results if r["group"] == "collectives" and r["name"] == "init"
        )
        assert "communicator SUPACommunicator over SCCL" in init["detail"], init

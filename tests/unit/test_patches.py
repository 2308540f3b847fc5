"""The patch ledger, the CLI error sentence, and the cpu torch.accelerator shim."""

from __future__ import annotations

import sys

import pytest
import torch

from vllm_br import patches
from vllm_br.device import cpu_accelerator
from vllm_br.device.cpu import CpuBackend
from vllm_br.errors import SUPAConfigError

SENTENCE = "--block-size 16 is not supported on SUPA; use --block-size 128."


# ---- ledger -----------------------------------------------------------------
def test_ledger_entries_are_documented():
    assert patches.LEDGER
    names = [p.name for p in patches.LEDGER]
    assert len(names) == len(set(names)), names
    for p in patches.LEDGER:
        for field in ("name", "target", "why", "remove_when", "scope", "upstream"):
            value = getattr(p, field)
            assert isinstance(value, str) and value.strip(), (p.name, field)


def test_ledger_upstream_references_name_existing_vllm_lines():
    """Each ``vllm/<file>:<line>`` an entry cites exists in the installed
    vLLM: a reference that outlives its file or line is caught here."""
    import re
    from pathlib import Path

    import vllm

    root = Path(vllm.__file__).resolve().parents[1]
    for p in patches.LEDGER:
        cited = 0
        for path, lines in re.findall(r"(vllm/[\w/]+\.py):([\d, ]+)", p.upstream):
            source = root / path
            assert source.is_file(), (p.name, path)
            length = len(source.read_text().splitlines())
            for line in re.findall(r"\d+", lines):
                assert 1 <= int(line) <= length, (p.name, path, line)
                cited += 1
        assert cited, f"{p.name}: upstream cites no vllm/<file>:<line>"


def test_every_applied_patch_is_in_the_ledger():
    names = {p.name for p in patches.LEDGER}
    assert set(patches._APPLY) <= names, set(patches._APPLY) - names


# ---- pil-decompression-bomb-limit ---------------------------------------------
def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("limit", [None, "0"], ids=["default", "disabled"])
def test_pil_bomb_limit_leaves_the_refusal_to_vllm(monkeypatch, limit):
    """An image over VLLM_MAX_IMAGE_PIXELS is refused by vLLM's own check
    (a ValueError: a 400 naming the setting) instead of PIL's
    DecompressionBombError (a 500); with the limit disabled (0) PIL's check
    stays."""
    from PIL import Image
    from vllm.multimodal.media.image import ImageMediaIO

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)  # PIL's default
    if limit is None:
        monkeypatch.delenv("VLLM_MAX_IMAGE_PIXELS", raising=False)
    else:
        monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", limit)
    bomb = _png(15000, 15000)  # 225,000,000 pixels
    with pytest.raises(Image.DecompressionBombError):
        ImageMediaIO().load_bytes(bomb)  # what vLLM alone does
    patches._APPLY["pil-decompression-bomb-limit"]()
    if limit is None:
        assert Image.MAX_IMAGE_PIXELS is None
        with pytest.raises(ValueError, match="exceed the maximum of 178956970 pixels"):
            ImageMediaIO().load_bytes(bomb)
        assert ImageMediaIO().load_bytes(_png(64, 48)).media.size == (64, 48)
    else:
        assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's own
        with pytest.raises(Image.DecompressionBombError):
            ImageMediaIO().load_bytes(bomb)


# ---- user_error_sentence ------------------------------------------------------
def test_sentence_of_a_supa_error():
    assert patches.user_error_sentence(SUPAConfigError(SENTENCE)) == SENTENCE


def test_sentence_found_through_cause_and_context():
    try:
        try:
            raise SUPAConfigError(SENTENCE)
        except SUPAConfigError as e:
            raise RuntimeError("engine start-up failed") from e
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == SENTENCE
        wrapped = outer

    try:
        try:
            raise wrapped
        except RuntimeError:
            raise KeyError("while handling")  # noqa: B904 (implicit __context__)
    except KeyError as outer:
        assert outer.__cause__ is None
        assert patches.user_error_sentence(outer) == SENTENCE


def test_sentence_found_inside_pydantic_validation_error():
    pydantic = pytest.importorskip("pydantic")

    class Settings(pydantic.BaseModel):
        block_size: int

        @pydantic.field_validator("block_size")
        @classmethod
        def _supa(cls, v: int) -> int:
            if v != 128:
                raise SUPAConfigError(SENTENCE)
            return v

    with pytest.raises(pydantic.ValidationError) as info:
        Settings(block_size=16)
    assert not isinstance(info.value, SUPAConfigError)
    assert patches.user_error_sentence(info.value) == SENTENCE

    # ... and a ValidationError chained inside another exception.
    try:
        raise RuntimeError("config failed") from info.value
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == SENTENCE


def test_sentence_from_vllm_config_validation_error(tiny_llama_dir, monkeypatch):
    # The real thing: VllmConfig (a pydantic dataclass) wraps the platform's
    # SUPAConfigError in a ValidationError.
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(Exception) as info:  # noqa: B017
        EngineArgs(model=str(tiny_llama_dir), block_size=16).create_engine_config()
    assert not isinstance(info.value, SUPAConfigError)
    sentence = patches.user_error_sentence(info.value)
    assert sentence is not None and "--block-size 16" in sentence
    assert "\n" not in sentence


def test_unknown_architecture_becomes_one_sentence():
    supported = ", ".join(f"Arch{i}ForCausalLM" for i in range(400))
    err = ValueError(
        "Model architectures ['FooBarForCausalLM'] are not supported for now. "
        f"Supported architectures: dict_keys([{supported}])"
    )
    sentence = patches.user_error_sentence(err)
    assert sentence is not None
    assert "FooBarForCausalLM" in sentence
    assert "Arch1ForCausalLM" not in sentence
    assert "\n" not in sentence and sentence.endswith(".")
    assert len(sentence) < 300
    # Also when vLLM's error is wrapped.
    try:
        raise RuntimeError("model config failed") from err
    except RuntimeError as outer:
        assert patches.user_error_sentence(outer) == sentence


def test_unrelated_error_has_no_sentence():
    assert patches.user_error_sentence(RuntimeError("boom")) is None
    assert patches.user_error_sentence(ValueError("bad value")) is None
    try:
        raise KeyError("x") from RuntimeError("y")
    except KeyError as e:
        assert patches.user_error_sentence(e) is None


def test_sentence_survives_a_reference_cycle():
    a = RuntimeError("a")
    b = RuntimeError("b")
    a.__context__ = b
    b.__context__ = a
    assert patches.user_error_sentence(a) is None


# ---- cpu torch.accelerator shim ----------------------------------------------
@pytest.fixture
def pristine_accelerator():
    """torch.accelerator without the shim, whatever state the session is in
    (the general plugin may have installed it already); put back afterwards."""
    acc = torch.accelerator
    was_installed = bool(cpu_accelerator._originals)
    current = {n: getattr(acc, n, None) for n in cpu_accelerator._NAMES}
    saved_originals = dict(cpu_accelerator._originals)
    cpu_accelerator.uninstall()
    try:
        yield {n: getattr(acc, n, None) for n in cpu_accelerator._NAMES}
    finally:
        cpu_accelerator.uninstall()
        if was_installed:
            cpu_accelerator._originals.update(saved_originals)
            for name, fn in current.items():
                setattr(acc, name, fn)


def test_cpu_accelerator_shim_install_and_uninstall(pristine_accelerator):
    originals = pristine_accelerator
    acc = torch.accelerator
    if not acc.is_available():
        # What vLLM would hit on the cpu backend without the shim.
        with pytest.raises(RuntimeError, match="accelerator"):
            acc.synchronize()

    backend = CpuBackend()
    cpu_accelerator.install(backend)
    cpu_accelerator.install(backend)  # idempotent
    acc.synchronize()
    acc.synchronize(0)
    acc.empty_cache()
    assert acc.current_device_index() == backend.current_device()
    free, total = acc.get_memory_info()
    assert 0 <= free <= total and total > 0
    assert acc.get_memory_info(0)[1] == total
    with acc.device_index(0):
        pass
    assert acc.memory_allocated() > 0
    assert acc.max_memory_allocated() >= 0
    assert "allocated_bytes.all.current" in acc.memory_stats()
    acc.reset_peak_memory_stats()
    assert acc.current_stream() == backend.current_stream()

    cpu_accelerator.uninstall()
    for name in cpu_accelerator._NAMES:
        assert getattr(acc, name, None) is originals[name], name
    assert not cpu_accelerator._originals


def test_cpu_accelerator_patch_installs_the_shim_on_cpu(
    pristine_accelerator, monkeypatch
):
    # The ledger's "cpu-torch-accelerator" patch installs the shim on cpu.
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    patches._APPLY["cpu-torch-accelerator"]()
    assert cpu_accelerator._originals
    torch.accelerator.synchronize()


# ---- Ray executor on SUPA devices ------------------------------------------------
def _one_sentence(msg: str) -> bool:
    return msg.count(". ") == 0 and msg.endswith(".")


@pytest.fixture
def pristine_ray_executor(monkeypatch):
    """vLLM's Ray executor with its own worker class for the test (an engine
    test may have installed the patch in this process); restored after."""
    from vllm.v1.executor import ray_executor_v2, ray_utils

    from vllm_br.executor import ray_worker

    monkeypatch.setattr(ray_executor_v2, "RayWorkerProc", ray_worker.RayWorkerProc)
    monkeypatch.setattr(
        ray_utils, "_wait_until_pg_ready", ray_utils._wait_until_pg_ready
    )
    return ray_executor_v2, ray_utils


def test_ray_executor_patch_swaps_the_worker_class(pristine_ray_executor):
    ray_executor_v2, ray_utils = pristine_ray_executor
    from vllm_br.executor import ray_worker

    patches._APPLY["ray-executor-supa-devices"]()  # the executor module is loaded
    assert ray_executor_v2.RayWorkerProc is ray_worker.SUPARayWorkerProc
    assert issubclass(ray_worker.SUPARayWorkerProc, ray_worker.RayWorkerProc)
    assert "get_node_and_physical_gpu_ids" in vars(ray_worker.SUPARayWorkerProc)
    wait = ray_utils._wait_until_pg_ready
    assert getattr(wait, "_vllm_br", False)
    patches.install_ray_executor()  # idempotent: the wait is wrapped once
    assert ray_utils._wait_until_pg_ready is wait


def test_ray_executor_patch_skips_processes_without_ray(monkeypatch):
    from vllm_br import compat

    monkeypatch.delitem(sys.modules, compat.RAY_EXECUTOR_MODULE)
    patches._APPLY["ray-executor-supa-devices"]()
    assert compat.RAY_EXECUTOR_MODULE not in sys.modules


def test_platform_installs_the_ray_patch_for_a_ray_config(
    pristine_ray_executor, monkeypatch
):
    from types import SimpleNamespace

    from vllm_br import platform
    from vllm_br.executor import ray_worker

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    parallel = SimpleNamespace(
        worker_cls="auto", enable_dbo=False, disable_custom_all_reduce=False
    )
    for use_ray, expected in (
        (False, ray_worker.RayWorkerProc),
        (True, ray_worker.SUPARayWorkerProc),
    ):
        parallel.use_ray = use_ray
        platform._apply_parallel_policy(SimpleNamespace(parallel_config=parallel))
        assert pristine_ray_executor[0].RayWorkerProc is expected


def test_ray_node_without_unit_instances_stops_in_one_sentence():
    from vllm_br.executor import ray_worker

    ray_worker.check_unit_instances("SUPA", None)
    ray_worker.check_unit_instances("TPU, SUPA", None)
    ray_worker.check_unit_instances(None, "SUPA")  # ray.init(_system_config=...)
    for env_value, system_config in ((None, None), ("TPU", "neuron_cores")):
        with pytest.raises(SUPAConfigError) as e:
            ray_worker.check_unit_instances(env_value, system_config)
        msg = str(e.value)
        assert "RAY_custom_unit_instance_resources=SUPA" in msg and _one_sentence(msg)


def test_ray_instance_ids_map_through_supa_visible_devices():
    from vllm_br.executor import ray_worker

    assert ray_worker.physical_ids([0, 1], None) == [0, 1]
    assert ray_worker.physical_ids([1], [3, 1]) == [1]
    assert ray_worker.physical_ids([0], [3, 1]) == [3]
    for ids, visible, needle in (
        ([2], [3, 1], """--resources '{"SUPA": 2}'"""),
        ([], None, "VLLM_RAY_PER_WORKER_GPUS"),
    ):
        with pytest.raises(SUPAConfigError) as e:
            ray_worker.physical_ids(ids, visible)
        assert needle in str(e.value) and _one_sentence(str(e.value))


def test_ray_cluster_without_supa_stops_in_one_sentence():
    from vllm_br.executor import ray_worker

    ray_worker.check_cluster_has_supa({"CPU": 2.0, "SUPA": 2.0})
    with pytest.raises(SUPAConfigError) as e:
        ray_worker.check_cluster_has_supa({"CPU": 2.0, "GPU": 1.0})
    msg = str(e.value)
    assert "--resources" in msg and "RAY_custom_unit_instance_resources" in msg
    assert _one_sentence(msg)


def test_worker_opens_the_card_vllm_assigned_to_its_local_rank(monkeypatch):
    # Ray executor: vLLM gives local rank r the r-th of the node's sorted
    # card ids; the worker opens that card's visible index.
    from vllm.platforms import interface

    from vllm_br.worker.worker import _device_index

    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)
    monkeypatch.delenv("SUPA_VISIBLE_DEVICES", raising=False)
    assert _device_index(None, 1) == 1  # multiprocessing: the local rank
    assert _device_index([4, 6], 1) == 6
    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)  # new process
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "3,1")
    assert [_device_index([1, 3], r) for r in (0, 1)] == [1, 0]


# ---- supernode TP groups (worker) -------------------------------------------------
def test_supernode_patch_wraps_its_ledger_target_in_the_worker():
    import importlib
    import inspect

    from vllm_br.distributed import supernode_groups
    from vllm_br.worker.worker import SUPAWorker

    entry = {p.name: p for p in patches.LEDGER}["supernode-tp-groups"]
    assert entry.scope == "worker"
    module_name, _, attr = entry.target.rpartition(".")
    module = importlib.import_module(module_name)
    was_installed = getattr(getattr(module, attr), "_vllm_br", False)
    supernode_groups.install()
    try:
        assert getattr(getattr(module, attr), "_vllm_br", False)
    finally:
        if not was_installed:
            supernode_groups.uninstall()
    # the worker installs it before vLLM creates its groups
    source = inspect.getsource(SUPAWorker.init_device)
    assert source.index("supernode_groups.install()") < source.index(
        "init_worker_distributed_environment("
    )

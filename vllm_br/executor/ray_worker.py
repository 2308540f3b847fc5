"""vLLM's Ray executor on SUPA devices (patch ledger: ray-executor-supa-devices).

vLLM's Ray worker actor asks Ray which devices it holds with
``ray.get_runtime_context().get_accelerator_ids()[current_platform.ray_device_key]``.
Ray lists only accelerators it has a built-in manager for, so "SUPA" is
missing there (KeyError). SUPA is a custom Ray resource instead: a node
started with ``--resources '{"SUPA": <cards>}'`` and
``RAY_custom_unit_instance_resources=SUPA`` hands each actor that requests
``SUPA: 1`` its own instance id (0 .. cards-1), which ``SUPARayWorkerProc``
reads. Without the variable every actor gets instance 0, so the workers
would share one card: the worker stops with a sentence instead.

Instance ids count the cards Ray was given on that node: with
``SUPA_VISIBLE_DEVICES`` set for ``ray start``, id i is its i-th entry, as Ray
does for CUDA_VISIBLE_DEVICES. vLLM sorts each node's ids and gives the
worker with local rank r the r-th (``assigned_physical_gpu_ids``);
``SUPAWorker`` selects that device.
"""

from __future__ import annotations

import importlib
import os

import ray
from vllm.platforms import current_platform

from vllm_br import compat, envs
from vllm_br.errors import SUPAConfigError
from vllm_br.logger import init_logger

logger = init_logger(__name__)

UNIT_INSTANCE_VAR = "RAY_custom_unit_instance_resources"
_UNIT_INSTANCE_CONFIG = "custom_unit_instance_resources"

_executor = importlib.import_module(compat.RAY_EXECUTOR_MODULE)
_ray_utils = importlib.import_module(compat.RAY_UTILS_MODULE)
RayWorkerProc = getattr(_executor, compat.RAY_WORKER_CLASS)


def _key() -> str:
    return current_platform.ray_device_key


def _lists_key(value: str | None) -> bool:
    return _key() in {name.strip() for name in (value or "").split(",")}


def check_unit_instances(env_value: str | None, system_config: str | None) -> None:
    """Raise unless Ray hands out the SUPA resource one instance per card."""
    key = _key()
    if not (_lists_key(env_value) or _lists_key(system_config)):
        raise SUPAConfigError(
            f"This Ray node does not hand out {key} devices one by one, so the "
            f"workers would share a card; start `ray start` on every node with "
            f"{UNIT_INSTANCE_VAR}={key} in its environment (next to "
            f"--resources '{{\"{key}\": <number of cards>}}')."
        )


def physical_ids(instance_ids: list[int], visible: list[int] | None) -> list[int]:
    """Ray's instance ids on this node -> SUPA device ids (SUPA_VISIBLE_DEVICES)."""
    key = _key()
    if not instance_ids:
        raise SUPAConfigError(
            f"Ray gave this worker no {key} instance; leave VLLM_RAY_PER_WORKER_GPUS "
            f"at 1 and start the node with --resources '{{\"{key}\": <cards>}}'."
        )
    if visible is None:
        return list(instance_ids)
    for i in instance_ids:
        if i >= len(visible):
            raise SUPAConfigError(
                f"Ray gave this worker {key} instance {i} but SUPA_VISIBLE_DEVICES "
                f"lists {len(visible)} cards on this node; start the node with "
                f"--resources '{{\"{key}\": {len(visible)}}}'."
            )
    return [visible[i] for i in instance_ids]


def _instance_ids() -> list[int]:
    key = _key()
    # Ray's own lookup behind get_accelerator_ids(), for our resource: the
    # instances of `key` and of its placement-group form `key_group_<pg id>`.
    worker = ray._private.worker.global_worker
    ids = worker.get_accelerator_ids_for_accelerator_resource(
        key, f"^{key}_group_[0-9A-Za-z]+$"
    )
    return sorted(int(i) for i in ids)


def _system_config_unit_instances() -> str | None:
    # A cluster started by ray.init(_system_config=...) has no variable.
    try:
        from ray._private.state import state

        return state.get_system_config().get(_UNIT_INSTANCE_CONFIG)
    except Exception:
        return None


def supa_device_ids() -> list[int]:
    """The SUPA devices Ray gave the calling Ray worker process."""
    env_value = os.environ.get(UNIT_INSTANCE_VAR)
    if not _lists_key(env_value):
        check_unit_instances(env_value, _system_config_unit_instances())
    return physical_ids(_instance_ids(), envs.SUPA_VISIBLE_DEVICES)


class SUPARayWorkerProc(RayWorkerProc):
    """vLLM's Ray worker actor; only the device-id lookup differs."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        # vLLM reads get_accelerator_ids()[key], which has no SUPA entry.
        return ray.get_runtime_context().get_node_id(), supa_device_ids()


def check_cluster_has_supa(cluster_resources: dict[str, float]) -> None:
    key = _key()
    if cluster_resources.get(key, 0) <= 0:
        raise SUPAConfigError(
            f"The Ray cluster has no {key} resource, so vLLM cannot place its "
            f"workers; start `ray start` on each SUPA server with --resources "
            f"'{{\"{key}\": <number of cards>}}' and {UNIT_INSTANCE_VAR}={key} in "
            "its environment, and point RAY_ADDRESS at that cluster (docs/ray.md)."
        )


def _wait_for_placement_group(wait):
    def wait_until_pg_ready(placement_group) -> None:
        # vLLM waits up to 30 minutes for a placement group Ray cannot place
        # (it allows for an autoscaler); with no SUPA anywhere, stop now.
        try:
            check_cluster_has_supa(ray.cluster_resources())
        except SUPAConfigError:
            ray.util.remove_placement_group(placement_group)
            raise
        return wait(placement_group)

    wait_until_pg_ready._vllm_br = True  # type: ignore[attr-defined]
    return wait_until_pg_ready


def install() -> None:
    """Make vLLM's Ray executor start SUPA workers (idempotent)."""
    setattr(_executor, compat.RAY_WORKER_CLASS, SUPARayWorkerProc)
    wait = getattr(_ray_utils, compat.RAY_PLACEMENT_GROUP_WAIT)
    if not getattr(wait, "_vllm_br", False):
        setattr(
            _ray_utils, compat.RAY_PLACEMENT_GROUP_WAIT, _wait_for_placement_group(wait)
        )
        logger.debug("vLLM's Ray executor patched for SUPA devices.")

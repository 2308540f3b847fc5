"""How a process vLLM started (engine core, worker) exits.

Python's last act before exiting is a full cyclic garbage collection over the
whole heap, which in a vLLM process (torch, transformers, vLLM and a model)
takes about 2.5 s on a 2-core host. It frees nothing the OS would not reclaim
at exit anyway, and every ``LLM`` shutdown or ``vllm serve`` stop waits for
it (vLLM's process manager joins its children). Freezing the heap at exit
(``gc.freeze()``: later collections skip what it holds) skips that scan, as
vLLM already does for a clean engine-core exit on ROCm
(``vllm/v1/engine/core.py``). vLLM's own teardown has already run
``gc.collect()`` by then (``cleanup_dist_env_and_memory``), so finalizers
that matter have run.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing

_installed = False


def _freeze_heap() -> None:
    gc.freeze()


def install_fast_exit() -> bool:
    """Register the freeze in a process started by ``multiprocessing`` (vLLM's
    engine core and workers); the user's own process is left as it is.
    Returns whether it is installed (idempotent)."""
    global _installed
    if _installed:
        return True
    if multiprocessing.parent_process() is None:
        return False
    # Registered first, so it runs last: after vLLM's and the libraries' own
    # atexit handlers (atexit runs in reverse order of registration).
    atexit.register(_freeze_heap)
    _installed = True
    return True

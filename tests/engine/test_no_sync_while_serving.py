"""Under async scheduling the host never waits for the device inside a step (docs/engine.md, "The host never waits
inside a step"): the next step is prepared while the device runs the previous one, and the only wait is on the
event of the step whose tokens a call returns. A synchronizing call (`.item()`, a copy from pageable memory,
`t[idx] = 0` on a device tensor: index_put_ copies its scalar through pageable memory) drains the device's queue
instead. torch's sync debug mode reports each such call; the test serves the no-JIT test's mixed workload (new
prefills beside decodes, prefix hits, an abort, hold-backs and parked requests, rows saved and restored) under
async scheduling and asserts none, naming the engine's frames."""

from __future__ import annotations

import threading
import traceback
import warnings

import pytest
import torch

from sparseserve import LLM
from tests.engine.test_no_jit_while_serving import engine_kwargs, serve
from tests.kernel_utils import gpu_only

ASYNC = ["layerseg_async", "layerseg_lag_async", "layerseg_lag_few_rows"]


class SyncSites:
    """The engine frames of every synchronizing call torch's sync debug mode warns about while open."""

    def __init__(self) -> None:
        self.sites: list[str] = []

    def __enter__(self) -> SyncSites:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing CUDA operation" not in str(message):  # (not the mode's own prototype notice)
            return
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if "sparseserve/" in f.filename] or stack[-6:]  # the engine's, else the innermost
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1])
        self.sites.append(f"[{threading.current_thread().name}] {where}: {message}")


@gpu_only
@pytest.mark.slow
@pytest.mark.parametrize("name", ASYNC)
def test_async_steps_never_wait_for_the_device(tiny_model_dir, name):
    llm = LLM(str(tiny_model_dir), **engine_kwargs(name))
    engine = llm.llm_engine
    assert engine.async_scheduling
    with SyncSites() as syncs:
        steps = serve(llm)
    assert not syncs.sites, f"{len(syncs.sites)} synchronizing calls in {steps} steps:\n" + "\n".join(
        sorted(set(syncs.sites))
    )
    assert not engine.has_unfinished_requests() and engine.allocator.num_used == 0

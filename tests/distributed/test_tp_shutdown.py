"""The order in which a tensor-parallel engine's ranks leave the process group: shutting the engine down ends the
groups' threads and connections at once (not when the model, a reference cycle, is collected at interpreter
exit, while the other ranks react to the closing connections), and rank 0's channel sends nothing after its last
message. The torchrun exit path itself: test_tensor_parallel.py::test_torchrun_environment_..."""

from __future__ import annotations

import gc
import os
import time

import pytest

from sparseserve import LLM
from sparseserve.distributed.channel import StepChannel
from sparseserve.distributed.group import TPGroup

# torch's names for its gloo threads: a connection's event loop and a process group's work threads
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def gloo_threads() -> int:
    """This process's native gloo threads, by name (Linux's /proc, where the engine runs)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sum(name in GLOO_THREADS for name in names)


def settled_gloo_threads(timeout: float = 5.0) -> int:
    """gloo_threads() once no earlier test's engine is still winding down: collected (a reference cycle may
    hold its groups) and two reads 0.2 s apart agree."""
    gc.collect()
    n, deadline = gloo_threads(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        n, last = gloo_threads(), n
        if n == last:
            break
    return n


def test_shutdown_ends_the_process_group_while_the_model_lives(tiny_model_dir):
    before = settled_gloo_threads()
    llm = LLM(str(tiny_model_dir), device="cpu", max_model_len=128, tensor_parallel_size=2)
    driver = llm.llm_engine.model_runner
    tp, model = driver.runner.tp, driver.runner.model  # references that outlive the engine's shutdown
    assert gloo_threads() > before  # the groups' threads, which the shutdown must end
    driver.shutdown()
    assert gloo_threads() == before
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        tp.cpu_group
    assert model is not None


class _Recorder(TPGroup):
    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2)
        object.__setattr__(self, "sent", [])

    def broadcast_object(self, obj=None):
        self.sent.append(obj)
        return obj


def test_no_heartbeat_after_the_last_message():
    tp = _Recorder()
    channel = StepChannel(tp, heartbeat_s=0.0)
    channel.heartbeat()
    assert tp.sent == [None]  # idle: a heartbeat
    channel.close("stop")
    channel.heartbeat()
    assert tp.sent == [None, "stop"]  # the ranks may be leaving the group: nothing follows the last message

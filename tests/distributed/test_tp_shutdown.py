"""The order in which a tensor-parallel engine's ranks leave the process group: shutting the engine down ends the
groups' threads and connections at once (not when the model, a reference cycle, is collected at interpreter
exit, while the other ranks react to the closing connections), and rank 0's channel sends nothing after its last
message. An NCCL group is aborted, never destroyed gracefully (its finalize waits for peers that already left),
and an end that blocks anyway returns after its timeout. The torchrun exit path itself:
test_tensor_parallel.py::test_torchrun_environment_..."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sparseserve import LLM
from sparseserve.distributed import group
from sparseserve.distributed.channel import StepChannel
from sparseserve.distributed.group import TPGroup, abort_tp_group, destroy_tp_group, get_tp_group, init_tp_group

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


@pytest.fixture
def nccl_like_group(monkeypatch):
    """This process's TP group over a real one-rank gloo world that reports NCCL as the device group's backend,
    as on GPUs; whatever the test leaves is cleaned up."""
    monkeypatch.setattr(group, "_TP", TPGroup())  # restored afterwards
    destroy = dist.destroy_process_group  # the real one: tests replace it
    with monkeypatch.context() as m:
        m.setattr(dist, "get_backend", lambda group=None: "nccl")
        tp = init_tp_group(
            rank=0, world_size=1, local_rank=0, local_world_size=1, device_type="cpu", store=dist.HashStore()
        )
    yield tp
    if dist.is_initialized():
        destroy()


@pytest.mark.parametrize("failed", [False, True], ids=["shutdown", "after-a-dead-rank"])
def test_leaving_an_nccl_group_aborts_it_and_never_waits_on_peers(nccl_like_group, monkeypatch, failed):
    tp, ended = nccl_like_group, []
    cpu_group = tp.cpu_group
    real_destroy, real_abort = dist.destroy_process_group, c10d._abort_process_group

    def destroy(group=None):  # the waiting destroy is recorded, never run
        ended.append(("destroy", group))
        if group is not None and group is not dist.group.WORLD:
            real_destroy(group)

    def abort(group=None):
        ended.append(("abort", group))
        real_abort(group)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(c10d, "_abort_process_group", abort)
    if failed:
        abort_tp_group()  # the watchdog, on a dead rank; the shutdown follows
    destroy_tp_group()
    # the gloo group ends as on CPU, the NCCL world is aborted: its graceful destroy is never called
    assert ended == ([] if failed else [("destroy", cpu_group)]) + [("abort", None)]
    assert not dist.is_initialized() and get_tp_group().world_size == 1
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        tp.device_group


def test_an_end_that_blocks_returns_after_its_timeout_with_a_warning(nccl_like_group, monkeypatch, caplog):
    release, real_abort = threading.Event(), c10d._abort_process_group

    def stuck_abort(group=None):  # blocks until the test lets it go
        release.wait(60)
        real_abort(group)

    monkeypatch.setattr(c10d, "_abort_process_group", stuck_abort)
    monkeypatch.setattr(group, "_END_STUCK", False)  # restored after: a later in-process exit must not fire
    exits = []
    monkeypatch.setattr(group.os, "_exit", exits.append)
    group.exit_if_end_stuck(3)
    assert exits == []  # nothing blocked yet: a normal exit
    try:
        with caplog.at_level(logging.WARNING, logger=group.__name__):
            destroy_tp_group(timeout_s=0.2)
        assert "did not end within" in caplog.text
        assert "stuck_abort" in caplog.text  # the warning says where the end waits
        assert dist.is_initialized() and get_tp_group().world_size == 1  # returned while the abort blocks
        group.exit_if_end_stuck(3)
        assert exits == [3]  # the status asked for, without the stuck communicators' destructors
    finally:
        release.set()
        for t in threading.enumerate():
            if t.name == "sparseserve-tp-end":
                t.join(30)
    assert not dist.is_initialized()


def test_rank_0_leaves_with_its_workers_then_joins_them(monkeypatch):
    """Rank 0 ends its groups while its workers end theirs (after the stop message), and joins them only
    then (joining first left it aborting alone), its decode graphs dropped before."""
    from sparseserve.engine import parallel

    order = []

    class Workers:
        def failure(self, wait_s: float = 0.0):
            return None

        def shutdown(self, timeout_s: float = 30.0):
            order.append("join")

    class Channel:
        def close(self, message):
            order.append("stop" if message.stop else "other")

        def heartbeat(self):
            pass

    class Runner:
        def release_graphs(self):
            order.append("graphs")

    monkeypatch.setattr(parallel, "destroy_tp_group", lambda *a, **k: order.append("leave"))
    session = parallel._Session(TPGroup(), Workers())
    session.channel, session.runner = Channel(), Runner()
    session.close()
    session.close()  # idempotent
    # the captured graphs go first: an NCCL communicator's end may wait for the graphs that launch it
    assert order == ["stop", "graphs", "leave", "join"]

"""`sparseserve serve --tensor-parallel-size 2` in a real process, as scripts/gpu_tp_check.sh's serve modes
start it (gloo on CPU; NCCL, CUDA graphs and Triton too where 2 GPUs are visible): it answers what one rank
answers and exits 0 on SIGINT with every rank gone; a rank killed mid-stream ends that stream with an error
event, later requests and /health get a 503 naming the rank, and the server still exits 0 with no process left."""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import httpx
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.models.loader import DEFAULT_MODEL_DIR
from tests.server_utils import server_log, start_server_process

pytestmark = pytest.mark.slow  # real server processes
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])
LEAVE_BOUND_S = 30.0  # for the ranks to be gone after the server exits, and for a dead rank to surface


def _flags(device: str) -> tuple[str, ...]:
    # a fixed KV cache: on a GPU the pytest process (rank 0's device too) may hold memory of earlier tests
    return ("--device", device, "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "256",
            "--tensor-parallel-size", "2")  # fmt: skip


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux's /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:  # gone meanwhile
            continue
        if int(ppid) == pid and state != "Z":
            out.append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = _children(todo.pop())
        found.update(kids)
        todo.extend(kids)
    return found


def _workers(server_pid: int) -> list[int]:
    """The spawned ranks: the children of the server's forkserver."""
    forkservers = []
    for pid in _children(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"forkserver" in f.read():
                    forkservers.append(pid)
        except OSError:
            pass
    return [w for fs in forkservers for w in _children(fs)]


def _stop(proc, spawned: set[int]) -> str:
    """SIGINT as gpu_serve_check.sh sends it: exit status 0, then no process it started is left."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, server_log(proc)[-3000:]
    deadline = time.monotonic() + LEAVE_BOUND_S
    while any(_alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in spawned if _alive(p)], "a process the server started outlived it"
    return server_log(proc)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reference(device: str, prompt: str, max_tokens: int) -> str:
    """One rank's greedy text (then its memory is given back: the server's rank 0 shares the device)."""
    llm = LLM(str(DEFAULT_MODEL_DIR), device=device, dtype="float32", max_model_len=1024, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return text


@pytest.mark.parametrize("device", DEVICES)
def test_serves_what_one_rank_does_and_exits_cleanly(device):
    expected = _reference(device, "Hello there", 12)
    proc, url = start_server_process(*_flags(device))
    try:
        spawned = _descendants(proc.pid)
        assert _workers(proc.pid), "no spawned rank"
        body = {"prompt": "Hello there", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        log = _stop(proc, spawned)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log, log[-3000:]
    assert "0 KV blocks in use" in log


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_killed_mid_stream_ends_it_and_the_server_still_exits(device):
    proc, url = start_server_process(*_flags(device))
    try:
        spawned = _descendants(proc.pid)
        (worker,) = _workers(proc.pid)
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"prompt": "Tell a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
        t0, events = time.monotonic(), []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(worker, signal.SIGKILL)
                    t0 = time.monotonic()
        took = time.monotonic() - t0
        assert events[-1] == "[DONE]" and took < LEAVE_BOUND_S
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and f"rank 1 (pid {worker}) was killed by signal 9" in error["message"]
        assert sum("choices" in json.loads(e) for e in events[:-2]) < 900  # cut short, not finished
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "again", "max_tokens": 3}, timeout=60)
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
        h = httpx.get(f"{url}/health")  # a load balancer restarts it
        assert h.status_code == 503 and f"rank 1 (pid {worker}) was killed by signal 9" in h.json()["error"]["message"]
        log = _stop(proc, spawned)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "engine stopped: 0 request(s) aborted, 0 KV blocks in use" in log, log[-3000:]

"""Back-pressure: a stream whose client stops reading stops generating. Past --max-unread-stream-tokens unread
tokens its request is aborted (KV blocks freed); the stream ends with the deltas queued before, an error
event and [DONE], so a non-reading client holds a bounded amount of the server's memory (README, Server)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest

from sparseserve.engine.async_engine import RequestAborted, RequestStream
from sparseserve.metrics import parse_metrics
from sparseserve.outputs import CompletionOutput, RequestOutput
from tests.server_utils import server_process


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def delta(tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * tokens, list(range(tokens)))], finished)


def test_a_stream_past_its_unread_bound_is_aborted_after_its_queued_deltas():
    engine = FakeEngine()

    async def scenario() -> tuple[list[int], BaseException | None]:
        stream = RequestStream("r", engine, max_unread_tokens=10)  # type: ignore[arg-type]
        for _ in range(3):
            stream.put(delta(3))  # 9 unread: within the bound
        assert not engine.aborted
        got = [len((await stream.__anext__()).outputs[0].token_ids)]  # the three, folded: 0 unread
        for _ in range(3):
            stream.put(delta(4))
        assert engine.aborted == ["r"]  # 12 > 10
        stream.put(delta(4))  # dispatched before the abort took effect: dropped
        got.append(len((await stream.__anext__()).outputs[0].token_ids))
        try:
            await stream.__anext__()
        except RequestAborted as e:
            return got, e
        return got, None

    got, error = asyncio.run(scenario())
    assert got == [9, 12] and error is not None and "--max-unread-stream-tokens" in str(error)
    assert engine.aborted == ["r"]


def test_a_reading_consumer_is_never_aborted():
    engine = FakeEngine()

    async def scenario() -> int:
        stream = RequestStream("r", engine, max_unread_tokens=4)  # type: ignore[arg-type]
        total = 0
        for i in range(50):
            stream.put(delta(3, finished=i == 49))
            out = await stream.__anext__()
            total += len(out.outputs[0].token_ids)
        return total

    assert asyncio.run(scenario()) == 150 and not engine.aborted


STREAMS, MAX_TOKENS, BOUND, BUF = 40, 1000, 8, 4096
KB_PER_TOKEN = 11  # README: 5.3 KB in the engine and 5.3 KB queued with 20 logprobs


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads a process's memory from /proc")
def test_non_reading_streams_stop_generating_and_memory_stays_bounded():
    flags = (
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "2048",
        "--max-unread-stream-tokens",
        str(BOUND),
        "--socket-send-buffer-bytes",
        str(BUF),
    )
    with server_process(*flags) as (proc, url):

        def metrics() -> dict[str, float]:
            return parse_metrics(httpx.get(f"{url}/metrics").text)

        request = {
            "prompt": "Tell a long story.",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 20,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json={**request, "max_tokens": 16}, timeout=60) as r:
            chunk = min(len(line) for line in r.iter_lines() if line.startswith("data: {"))
        # A non-reading client's output waits in its receive buffer and the server's send buffer (each at most
        # twice what is set: Linux doubles it), the server's write buffer, then at most BOUND tokens queued; the
        # step running when the abort comes adds one. Other tokens' chunks may be shorter: half the shortest.
        tokens_per_stream = 5 * BUF // (chunk // 2) + BOUND + 1
        rss0, gen0 = rss(proc.pid), metrics()["sparseserve:generation_tokens_total"]
        body = json.dumps(request).encode()
        port = int(url.rsplit(":", 1)[1])
        socks = []
        try:
            for _ in range(STREAMS):  # clients that send a request and never read
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)
                s.connect(("127.0.0.1", port))
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                socks.append(s)
            deadline = time.monotonic() + 300
            while True:  # every stream's request aborted: nothing runs, no block is held
                m = metrics()
                if (
                    m["sparseserve:num_requests_running"] == m["sparseserve:num_requests_waiting"] == 0
                    and m["sparseserve:generation_tokens_total"] > gen0
                ):
                    break
                assert time.monotonic() < deadline, m
                time.sleep(0.5)
            assert m["sparseserve:kv_cache_blocks_used"] == 0
            generated, rss1 = m["sparseserve:generation_tokens_total"] - gen0, rss(proc.pid)
            time.sleep(3)  # the clients still do not read: nothing more is generated, memory stays
            m2, rss2 = metrics(), rss(proc.pid)
        finally:
            for s in socks:
                s.close()
    assert m2["sparseserve:generation_tokens_total"] - gen0 == generated
    assert generated <= STREAMS * tokens_per_stream < STREAMS * MAX_TOKENS / 4, (generated, chunk)
    # KV pages and allocator slack aside (64 MiB), what grew is the streams' tokens
    assert rss2 - rss0 <= STREAMS * tokens_per_stream * KB_PER_TOKEN * 1024 + 64 * 2**20, (rss0, rss1, rss2)
    assert rss2 - rss1 <= 8 * 2**20, (rss1, rss2)

"""Test helpers for the OpenAI server: an app of `build_app` on a real socket in a background thread."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
from fastapi import FastAPI

from sparseserve.entrypoints.http_server import running_server


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", **options: Any) -> Iterator[str]:
    """Runs the app on a free port; yields its base URL. For tests that need a real socket (streaming,
    disconnects, the openai client); `options` go to http_server.running_server (limits, shutdown_timeout)."""
    with running_server(app, app.state.engine, host, **options) as (url, _):
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(*flags: str) -> tuple[subprocess.Popen, str]:
    """`sparseserve serve` on the embedded model in a real process (CPU, a free port), once /health answers 200.
    Its log (stderr) goes to a file that server_log reads (a pipe nobody drains would stall a chatty server)."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparseserve",
            "serve",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--uvicorn-log-level",
            "info",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    proc.log = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {server_log(proc)}")
        time.sleep(0.1)


def server_log(proc: subprocess.Popen) -> str:
    """What a process of start_server_process has logged so far."""
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()  # type: ignore[attr-defined]


@contextlib.contextmanager
def server_process(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """start_server_process, killed on the way out if still running."""
    proc, url = start_server_process(*flags)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

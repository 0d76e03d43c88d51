"""Test helpers for the OpenAI server: an app of `build_app` on a real socket in a background thread."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

from sparseserve.entrypoints.http_server import running_server


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", **options: Any) -> Iterator[str]:
    """Runs the app on a free port; yields its base URL. For tests that need a real socket (streaming,
    disconnects, the openai client); `options` go to http_server.running_server (limits, shutdown_timeout)."""
    with running_server(app, app.state.engine, host, **options) as (url, _):
        yield url

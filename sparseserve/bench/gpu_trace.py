"""Where a window of engine steps spends its time (torch profiler): the GPU's critical path by kernel and by kind
of work, and the host calls that blocked, with the engine functions that made them. A blocking copy (one through
pageable memory, a `.tolist()`) shows as a long `cudaMemcpyAsync` and, under async scheduling, as GPU time with
nothing beside it (docs/architecture.md, principle 5). Used by scripts/profile_decode.py and
`benchmarks.decode_time --profile-window`."""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch

# kernel or copy name fragment -> kind of work (first match; lower case)
KINDS = (
    ("device -> pageable", "d2h pageable"),
    ("pageable -> device", "h2d pageable"),
    ("dtoh", "d2h"),
    ("htod", "h2d copy"),
    ("dtod", "d2d"),
    ("flash_h2d", "flash_h2d"),
    ("write_through", "flash_h2d"),
    ("sparse_", "sparse attention"),
    ("decode_", "decode attention"),
    ("prefill", "prefill attention"),
    ("pool", "pool plan"),
    ("score", "selection"),
    ("select", "selection"),
    ("gemm", "gemm"),
    ("nvjet", "gemm"),
    ("cutlass", "gemm"),
    ("splitk", "gemm"),
)
BLOCKING = ("cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def kind(name: str) -> str:
    low = name.lower()
    return next((k for frag, k in KINDS if frag in low), "other")


def critical_path(trace: list[dict]) -> tuple[float, float, collections.Counter]:
    """(busy us, idle us, us by kernel name) of the GPU's timeline in a Chrome trace: each kernel or
    copy counts only past the end of what ran before it, so kernels that overlap (programmatic
    dependent launch starts one before its predecessor ends; side streams) are not counted twice."""
    ops = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in trace
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    by_name: collections.Counter = collections.Counter()
    if not ops:
        return 0.0, 0.0, by_name
    busy = idle = 0.0
    last = ops[0][0]
    for start, end, name in ops:
        idle += max(0.0, start - last)
        own = max(0.0, end - max(start, last))
        by_name[name] += own
        busy += own
        last = max(last, end)
    return busy, idle, by_name


LAYER_MARK = "_rotary_kernel"  # launched once a decoder layer (layers/rotary.py): the layers' clock


def layer_times(trace: list[dict], num_layers: int, mark: str = LAYER_MARK) -> list[float] | None:
    """Per decoder layer position 0..num_layers-2: the median us from its marker kernel's start to the next layer's,
    over the whole steps in a Chrome trace (each step launches the marker once a layer; a leading partial step, e.g.
    another engine's step in flight, is dropped). The last layer runs into the step's tail: not measured. None: no
    whole step."""
    starts = sorted(e["ts"] for e in trace if e.get("ph") == "X" and e.get("cat") == "kernel" and e["name"] == mark)
    steps = len(starts) // num_layers if num_layers > 1 else 0
    if steps == 0:
        return None
    starts = starts[len(starts) - steps * num_layers :]
    per = [
        sorted(starts[s * num_layers + i + 1] - starts[s * num_layers + i] for s in range(steps))
        for i in range(num_layers - 1)
    ]
    return [(v[(steps - 1) // 2] + v[steps // 2]) / 2 for v in per]


def by_stream(trace: list[dict]) -> dict[str, dict[str, float]]:
    """ms of GPU work by stream and kind, each op's whole duration (beside other streams' work or not): the
    compute stream's own time and what the side streams (copies, CUDA graphs' branches) ran beside it."""
    out: dict = collections.defaultdict(collections.Counter)
    for e in trace:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out[str(e.get("args", {}).get("stream", e.get("tid")))][kind(e["name"])] += e["dur"] / 1e3
    return {k: dict(v) for k, v in out.items()}


@dataclass
class WindowReport:
    """A profiled window: GPU busy and idle ms, critical-path ms by kind and by kernel, the blocking host
    calls by (call, the innermost engine functions above it): [count, ms]; with the model's layer count, each
    layer position's time (layer_times); ms by stream and kind (by_stream)."""

    busy_ms: float
    idle_ms: float
    by_kind: dict[str, float]
    by_kernel: dict[str, float]
    blocking: dict[tuple[str, tuple[str, ...]], list] = field(default_factory=dict)
    layer_us: list[float] | None = None
    streams: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "gpu_busy_ms": self.busy_ms,
            "gpu_idle_ms": self.idle_ms,
            "critical_path_ms_by_kind": self.by_kind,
            "critical_path_ms_by_kernel": self.by_kernel,
            "blocking_host_calls": [
                {"call": call, "callers": list(where), "count": n, "ms": ms}
                for (call, where), (n, ms) in self.blocking.items()
            ],
            "layer_us": self.layer_us,
            "ms_by_stream_and_kind": self.streams,
        }

    def lines(self, kernels: int = 12, callers: int = 8, streams: int = 4) -> list[str]:
        out = [f"GPU busy {self.busy_ms:.1f} ms, idle {self.idle_ms:.1f} ms; critical path by kind (ms):"]
        out += [f"  {k:20s} {ms:9.1f}" for k, ms in sorted(self.by_kind.items(), key=lambda kv: -kv[1])]
        out.append("critical path by kernel (ms):")
        top = sorted(self.by_kernel.items(), key=lambda kv: -kv[1])[:kernels]
        out += [f"  {name[:80]:80s} {ms:9.1f}" for name, ms in top]
        out.append("streams by their work (ms; each op whole, beside other streams or not):")
        for sid, kinds in sorted(self.streams.items(), key=lambda kv: -sum(kv[1].values()))[:streams]:
            top = ", ".join(f"{k} {ms:.1f}" for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1])[:5])
            out.append(f"  stream {sid:>6s} {sum(kinds.values()):9.1f}: {top}")
        out.append("blocking host calls (count, ms; the engine functions above them):")
        rows = sorted(self.blocking.items(), key=lambda kv: -kv[1][1])[:callers]
        for (call, where), (n, ms) in rows:
            out.append(f"  {call} x{n}: {ms:.1f} ms  <- {' <- '.join(where) or '?'}")
        return out


def blocking_calls(trace: list[dict], depth: int = 3, reach: int = 20000) -> dict[tuple[str, tuple[str, ...]], list]:
    """The blocking host calls (BLOCKING) of a Chrome trace by (call, the innermost `depth` Python frames of
    sparseserve/ or benchmarks/ that enclose it on its thread): [count, ms]. From the trace's times, not the
    profiler's parent links: a CUDA runtime call has none to its Python frames. reach: the frames looked back."""
    frames: dict = collections.defaultdict(list)  # tid -> [(start, end, file(line): function)]
    calls = []
    for e in trace:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "python_function" and ("sparseserve/" in e["name"] or "benchmarks/" in e["name"]):
            frames[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"].rsplit("/", 1)[-1]))
        elif e["name"] in BLOCKING:
            calls.append(e)
    for f in frames.values():
        f.sort()
    out: dict = {}
    for c in calls:
        f, end, found = frames.get(c["tid"], []), c["ts"] + c["dur"], []
        i = bisect.bisect_right(f, (c["ts"], math.inf, ""))
        for start, stop, name in reversed(f[max(0, i - reach) : i]):  # the latest-starting encloser is innermost
            if stop >= end and start <= c["ts"]:
                found.append(name)
                if len(found) == depth:
                    break
        row = out.setdefault((c["name"], tuple(found)), [0, 0.0])
        row[0] += 1
        row[1] += c["dur"] / 1e3
    return out


class WindowProfile:
    """torch.profiler over the steps between `start()` and `stop()`; CUDA activity where there is a GPU.
    trace_path: where `stop` also writes the Chrome trace, gzipped (Perfetto opens it), or None. stack: record
    Python frames (the blocking calls' callers); the trap: they cost the host tens of us a call, so a host-bound
    stretch shows GPU idle that the unprofiled run does not have (stack=False keeps the idle time closer to it)."""

    def __init__(self, trace_path: str | None = None, stack: bool = True) -> None:
        self.trace_path = trace_path
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, with_stack=stack)

    def start(self) -> None:
        self._prof.start()

    def stop(self, num_layers: int = 0) -> WindowReport:
        """num_layers: the model's, for the per-layer times (0: none)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self._prof.export_chrome_trace(path)
            if self.trace_path:
                with open(path, "rb") as f, gzip.open(self.trace_path, "wb") as g:
                    shutil.copyfileobj(f, g)
            with open(path) as f:
                trace = json.load(f)["traceEvents"]
        busy, idle, by_name = critical_path(trace)
        by_kind: collections.Counter = collections.Counter()
        for name, us in by_name.items():
            by_kind[kind(name)] += us / 1e3
        blocking = blocking_calls(trace)
        by_kernel = {n: us / 1e3 for n, us in by_name.items()}
        layers = layer_times(trace, num_layers) if num_layers else None
        return WindowReport(busy / 1e3, idle / 1e3, dict(by_kind), by_kernel, blocking, layers, by_stream(trace))

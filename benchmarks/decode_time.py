"""Where a request's decode time goes under load: the conversation trace replayed in-process (benchmarks/common.py's
`replay`: each request added at its arrival time, LLMEngine stepped until all finished) with the time of every
token, and each request's time per output token split by what the engine did between its tokens.

Every interval between two tokens of a request ends with the engine step that produced the second token; the
steps before it in the interval produced none for this request (held back by the working-set limit, parked
after a prefill ahead, preempted, or not scheduled). So a request's TPOT is the sum of three parts, each over
its output tokens - 1:
- decode: intervals whose producing step ran decodes only;
- with prefill: the producing step also ran prompt tokens (a prefill chunk, or a layer-segmented prefill's
  segment), or under async scheduling the step launched beside it did: the decode waited for them;
- waiting: steps of the interval that produced no token for it; `waiting_mid_answer` is its part after the
  request's second token (held back or parked mid-answer; the rest is the first-to-second gap of prefill ahead).
Under async scheduling a step's tokens come out of the next `step()` call: the time between two calls is the
device time of the step launched in the earlier one, which is the step that produced them, unless the later call
launches a prefill: a launch of more kernels than the launch queue holds (~1,000: a layer-segmented prefill's
segment) returns only when the device nears that step's end, so that call carries the prefill's time and counts
as one with prefill (docs/benchmarks/serving.md, twenty-fourth session). `decode_stalls` / `decode_stall_s`:
decode-only steps over 40x the median one (a kernel compiled while serving). The JSON's `prefill_by_prompt`: each
prompt's tokens and the seconds booked to its work, the decode rows beside it included (a fit of a per-prompt
constant and per-token costs over them did not separate the two on the GPU: docs/benchmarks/serving.md,
twenty-sixth session).

    python -m benchmarks.decode_time --configs dense layerseg_async [--time-scale 1] [--json out.json]
    python -m benchmarks.decode_time --model mha7b --dataset longbench --longbench-tokenizer llama2 \
        --num-requests 48 --output-len 1024 --gpu-memory-gb 40 --engine-arg host_kv_memory=90GB \
        --configs dense sparse_async kvoffload_async --fresh-process     # issue 38's decode-heavy load

With `dense` among the configs a second table (and the JSON's `against_dense`) gives each config's throughput,
mean TTFT (times lower) and TPOT as ratios to it, in the same call. `--fresh-process` runs each config in a Python
process of its own, as a fresh server would (one process: a config after another can run slower,
docs/benchmarks/serving.md, thirteenth session).

`--gauges-every N` samples the engine's gauges every N steps (running and waiting requests; with KV offload the
device rows, device blocks and working sets held against what each may take): where the device budget sits
(docs/benchmarks/serving.md, fourteenth session); the row gets their maxima, the JSON every sample.

`--profile-window START N` torch-profiles those steps of each config: the GPU's critical path by kind of work and
the host calls that blocked, with the engine functions that made them (bench/gpu_trace.py; how the pageable
saves of docs/offload.md, "Saves through the kernel", were found). `--no-profile-stack` records no Python frames (no
callers then), whose host cost would show a host-bound step's GPU idle time larger than it is.

Configurations (the serving ladder's, scripts/gpu_serve_check.sh): dense; sparse (topk 2048); offload (+
kv_offload, working-set control included, chunked prefill); layerseg (+ layer_segmented_prefill); offload_lag,
layerseg_lag (+ sparse_lag 1); kvoffload (`kv_offload` with its defaults: on these shapes layerseg_lag); each
synchronous, NAME_async with async_scheduling (`kvoffload_async`: a user's `--kv-offload` on CUDA). A config
may carry engine arguments of its own, so variants run beside dense in one call:
`--configs dense kvoffload_async kvoffload_async:segment_decode_steps=1` (each row is named by its spec).
`--model 8b` (or a benchmarks/model_dir.py preset: mha7b, gqa8b): those shapes over the embedded tokenizer's
vocabulary, dummy bf16 weights, GPU memory capped at --gpu-memory-gb. `--dataset longbench`: LongBench v1's mix
(the SparseServe paper's serving workload) instead of the conversation trace. Any model directory works; on CPU
the smoke test runs it with a tiny model (tests/benchmarks/test_decode_time.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    Job,
    add_replay_args,
    add_workload_args,
    engine_kwargs,
    fresh_engine,
    max_output_len,
    model_dir,
    replay,
    workload_jobs,
)
from sparseserve.bench.accuracy import parse_engine_args
from sparseserve.bench.gpu_trace import WindowProfile, WindowReport
from sparseserve.bench.hardware import print_table
from sparseserve.profiler import Profiler

logger = logging.getLogger(__name__)

_SPARSE = dict(sparse_policy="topk", sparse_budget=2048)
_LADDER = {
    "dense": {},
    "sparse": _SPARSE,
    # the ladder's rungs name what they add (KV offload's default lag is the last rung's)
    "offload": _SPARSE | dict(kv_offload=True, sparse_lag=0, layer_segmented_prefill=False),
    "layerseg": _SPARSE | dict(kv_offload=True, layer_segmented_prefill=True, sparse_lag=0),
}
_LADDER["offload_lag"] = _LADDER["offload"] | dict(sparse_lag=1)
_LADDER["layerseg_lag"] = _LADDER["layerseg"] | dict(sparse_lag=1)
_LADDER["kvoffload"] = _SPARSE | dict(kv_offload=True)  # as a user turns it on: its defaults (synchronous here)
# NAME: synchronous scheduling (KV offload's default on CUDA is async, so its rungs say so); NAME_async: async
_LADDER = {k: v | dict(async_scheduling=False) if v.get("kv_offload") else v for k, v in _LADDER.items()}
CONFIGS = _LADDER | {f"{k}_async": v | dict(async_scheduling=True) for k, v in _LADDER.items()}


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One `step()` call: when it returned, the seconds since the call before, the step that produced its tokens
    (decode rows, prompt tokens, layer segments) and the requests that got a token; launches_prefill: under async
    scheduling, whether the step the call launched (the next one) ran prompt tokens (its launch may block the
    call for most of that step's device time: the launch queue holds ~1,000 kernels). prompt_work: (request,
    prompt tokens) of the steps the duration is booked to: the producing one's and, where launches_prefill, the
    launched one's; a layer segment counts its share of the prompt (tokens x its layers / the model's)."""

    t: float
    duration: float
    decodes: int
    prompt_tokens: int
    segments: int
    requests: frozenset[str]
    launches_prefill: bool = False
    prompt_work: tuple[tuple[str, int], ...] = ()

    @property
    def prefills(self) -> bool:
        """The interval waited for prompt work: the producing step's, or (async) the launched step's."""
        return self.prompt_tokens > 0 or self.segments > 0 or self.launches_prefill


class Timeline(Profiler):
    """The engine's profiler and the `on_step` hook of `replay`: a StepRecord per engine step (async scheduling:
    a step's tokens come out one call later, with the schedule launched in the call before). A step's duration
    leaves out the time the replay slept before it with nothing to run (no request was decoding then).
    window (start, n): torch-profiles steps [start, start + n) (bench/gpu_trace.py; `profiled` its report), its
    Chrome trace gzipped to trace_path if given, Python frames recorded if stack."""

    def __init__(
        self,
        async_scheduling: bool,
        window: tuple[int, int] | None = None,
        trace_path: str | None = None,
        stack: bool = True,
    ) -> None:
        self.async_scheduling = async_scheduling
        self.window, self.trace_path, self.stack = window, trace_path, stack
        self._trace: WindowProfile | None = None
        self.profiled: WindowReport | None = None
        self.steps: list[StepRecord] = []
        self._sched: tuple[int, int, int] = (0, 0, 0)  # the newest schedule's decode rows, prompt tokens, segments
        self._work: tuple[tuple[str, int], ...] = ()  # the newest schedule's prompt work (StepRecord.prompt_work)
        self._launched: tuple[int, int, int] | None = None
        self._launched_work: tuple[tuple[str, int], ...] = ()
        self._last_t = 0.0

    def on_schedule(self, out) -> None:
        # Rows of more than one token are prompt chunks; a decode row has one (a one-token last prompt chunk
        # counts as a decode: the same work).
        self._sched = (
            sum(1 for _, n in out.scheduled if n == 1),
            sum(n for _, n in out.scheduled if n > 1),
            len(out.segments),
        )
        work = [(seq.request_id, n) for seq, n in out.scheduled if n > 1]
        self._work = tuple(work + [(seg.seq.request_id, seg.cost) for seg in out.segments])

    def __call__(self, outputs: list, t: float, idle: float = 0.0) -> None:
        launched, self._sched = self._sched, (0, 0, 0)
        work, self._work = self._work, ()
        produced, blocked = launched, False
        if self.async_scheduling:
            produced, self._launched = self._launched or (0, 0, 0), launched
            blocked = launched[1] > 0 or launched[2] > 0
            produced_work, self._launched_work = self._launched_work, work
            work = produced_work + (work if blocked else ())
        got = frozenset(o.request_id for o in outputs if any(c.token_ids for c in o.outputs))
        self.steps.append(StepRecord(t, t - self._last_t - idle, *produced, got, blocked, work))
        self._last_t = t
        if self.window is not None:
            start, n = self.window
            if len(self.steps) == start:
                self._trace = WindowProfile(self.trace_path, self.stack)
                self._trace.start()
            elif len(self.steps) == start + n and self._trace is not None:
                self.profiled, self._trace = self._trace.stop(), None

    def close(self) -> None:
        """Ends a window the replay ended inside (no report: torch's profiler may fail to parse what it holds then),
        so that the next config's profiler can start."""
        if self._trace is not None:
            trace, self._trace = self._trace, None
            try:
                trace.stop()
            except Exception as e:  # noqa: BLE001 - the window is lost, not the run
                logger.warning("profile window past the replay's end (%d steps): no report (%s)", len(self.steps), e)


# Engine gauges that show where the device budget sits (--gauges-every).
GAUGES = (
    "num_running",
    "num_waiting",
    "num_blocks_used",
    "num_blocks_total",
    "offload_device_rows",
    "offload_device_rows_used",
    "offload_device_blocks",
    "offload_device_blocks_used",
    "working_set_blocks",
    "working_set_limit",
    "working_set_parked",
    "working_set_held_back",
)


class GaugeLog:
    """The replay's on_step hook around the timeline: every `every` steps, the step's index and time and the
    engine's GAUGES (get_stats without a sync: the device's as of the newest landed step)."""

    def __init__(self, engine, timeline: Timeline, every: int) -> None:
        self.engine, self.timeline, self.every = engine, timeline, every
        self.samples: list[dict] = []

    def __call__(self, outputs: list, t: float, idle: float = 0.0) -> None:
        self.timeline(outputs, t, idle)
        n = len(self.timeline.steps)
        if n % self.every == 0:
            stats = self.engine.get_stats()
            self.samples.append({"step": n, "t": t} | {k: getattr(stats, k) for k in GAUGES})

    def summary(self) -> dict:
        """The most of each budget part held, and the working sets' mean share of their limit while requests waited
        (the pool binds where it is near 1)."""
        if not self.samples:
            return {}
        out = {f"{k}_max": max(s[k] for s in self.samples) for k in GAUGES if k.endswith("_used")}
        held = [
            s["working_set_blocks"] / s["working_set_limit"]
            for s in self.samples
            if s["num_waiting"] and s["working_set_limit"]
        ]
        if held:
            out["working_set_share_while_waiting"] = statistics.fmean(held)
        return out


STALL = 40  # a decode-only step this many times the median is a stall (decompose)
DETAIL = ("profile", "gauges", "prefill_by_prompt")  # row fields for the JSON, not the printed table


def decompose(steps: list[StepRecord]) -> dict:
    """Mean TPOT over the requests with two or more tokens and its three parts (module docstring), in ms; the
    producing steps' counts and durations."""
    token_steps: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for r in s.requests:
            token_steps.setdefault(r, []).append(i)
    parts = {"decode": [], "with_prefill": [], "waiting": []}
    mid_answer = []  # of waiting: after the request's second token
    for idx in token_steps.values():
        if len(idx) < 2:
            continue
        acc = dict.fromkeys([*parts, "mid"], 0.0)
        for i, (a, b) in enumerate(zip(idx, idx[1:])):
            acc["with_prefill" if steps[b].prefills else "decode"] += steps[b].duration
            waited = sum(steps[k].duration for k in range(a + 1, b))
            acc["waiting"] += waited
            acc["mid"] += waited if i else 0.0
        for k in parts:
            parts[k].append(acc[k] / (len(idx) - 1))
        mid_answer.append(acc["mid"] / (len(idx) - 1))
    mean = lambda v: 1e3 * statistics.fmean(v) if v else 0.0  # noqa: E731
    dec = [s for s in steps if s.requests and not s.prefills]
    mix = [s for s in steps if s.requests and s.prefills]
    # decode-only steps over STALL x the median: a kernel compiled while serving
    median = statistics.median([s.duration for s in dec]) if dec else 0.0
    stalls = [s.duration for s in dec if s.duration > STALL * median]
    out = {
        "requests_decoded": len(parts["decode"]),
        "tpot_ms": sum(mean(v) for v in parts.values()),
        **{f"{k}_ms": mean(v) for k, v in parts.items()},
        "waiting_mid_answer_ms": mean(mid_answer),
        "decode_steps": len(dec),
        "decode_step_ms": mean([s.duration for s in dec]),
        "decode_batch": statistics.fmean([s.decodes for s in dec]) if dec else 0.0,
        "decode_stalls": len(stalls),
        "decode_stall_s": sum(stalls),
        "prefill_steps": len(mix),
        "prefill_step_ms": mean([s.duration for s in mix]),
        "prefill_s": sum(s.duration for s in mix),
        "prefill_step_batch": statistics.fmean([s.decodes for s in mix]) if mix else 0.0,
        "prefill_step_tokens": statistics.fmean([s.prompt_tokens for s in mix]) if mix else 0.0,
    }
    return out


def prefill_by_prompt(steps: list[StepRecord]) -> dict[str, tuple[int, float]]:
    """Each request's prompt tokens computed and the seconds booked to them: a record's duration split over its
    prompt work by tokens (the decode rows beside them included)."""
    out: dict[str, tuple[int, float]] = {}
    for s in steps:
        total = sum(n for _, n in s.prompt_work)
        for r, n in s.prompt_work:
            tokens, sec = out.get(r, (0, 0.0))
            out[r] = (tokens + n, sec + s.duration * n / total)
    return out


def config_kwargs(spec: str, engine_kw: dict) -> dict:
    """A config spec's engine arguments: NAME of CONFIGS, or NAME:KEY=VALUE,... whose own arguments override
    --engine-arg's (`engine_kw`), which override the config's."""
    name, _, own = spec.partition(":")
    if name not in CONFIGS:
        raise ValueError(f"config {spec!r}: {name!r} is none of {', '.join(CONFIGS)}")
    return CONFIGS[name] | engine_kw | (parse_engine_args(own.split(",")) if own else {})


def _config_spec(spec: str) -> str:
    try:
        config_kwargs(spec, {})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def run_config(
    model: str,
    name: str,
    jobs: list[Job],
    engine_kw: dict,
    window: tuple[int, int] | None = None,
    gauges_every: int = 0,
    trace_dir: str | None = None,
    stack: bool = True,
) -> tuple[dict, list[StepRecord]]:
    """The config's row and its timeline; with a profiled window the row's "profile" is its report (and with
    trace_dir its Chrome trace there, NAME.trace.json.gz; stack: with Python frames), with gauges_every its
    "gauges" (GaugeLog's samples) and their summary."""
    config = config_kwargs(name, engine_kw)
    trace = str(Path(trace_dir) / f"{name.replace(':', '_')}.trace.json.gz") if trace_dir and window else None
    timeline = Timeline(False, window, trace, stack)
    with fresh_engine(timeline, model=model, **config) as engine:
        timeline.async_scheduling = engine.async_scheduling  # resolved: on by default with KV offload on CUDA
        gauges = GaugeLog(engine, timeline, gauges_every) if gauges_every else None
        summary = replay(engine, jobs, on_step=gauges or timeline)
        timeline.close()
        stats = engine.get_stats(sync=True)
    row = {
        "config": name,
        "output_tok_s": summary["output_tok_s"],
        "mean_ttft_s": summary["mean_ttft_s"],
        **decompose(timeline.steps),
        "computed_per_prompt": summary["computed_per_prompt"],
        "prefix_hit_rate": summary["hit_rate"],
        "preemptions": summary["preemptions"],
        "hold_backs": stats.working_set_hold_backs,
        "prefill_aheads": stats.working_set_prefill_aheads,
    }
    if stats.sparse_selections:  # what the lists attended, and (topp) how many were flat or held
        n = stats.sparse_selections
        row["tokens_per_list"] = stats.sparse_blocks_selected * stats.sparse_block_size / n
        row["flat_share"], row["held_share"] = stats.sparse_flat_lists / n, stats.sparse_held_lists / n
        # selections count every list a step attended, fresh or held: the share attended flat (a held list is one)
        row["flat_steps"] = (stats.sparse_flat_lists + stats.sparse_held_lists) / n
    if stats.offload_layer_steps:
        hits, loaded = stats.offload_hbm_hits, stats.offload_blocks_loaded + stats.offload_bypass_reads
        row["hbm_hit"] = hits / max(hits + stats.offload_hbm_misses, 1)
        row["loaded_per_layer_step"] = loaded / stats.offload_layer_steps
        row["rows_saved"], row["rows_restored"] = stats.offload_rows_saved, stats.offload_rows_restored
        row["pool_gb"] = stats.offload_hbm_bytes_pool / 1e9
        row["ws_limit"] = stats.working_set_limit
        row["ws_growth"] = stats.working_set_growth
    row["prefill_by_prompt"] = {r: list(v) for r, v in sorted(prefill_by_prompt(timeline.steps).items())}
    if gauges is not None:
        row |= gauges.summary() | {"gauges": gauges.samples}
    logger.info("%s", {k: v for k, v in row.items() if k not in DETAIL})
    if timeline.profiled is not None:
        start, n = window
        win = timeline.steps[start : start + n]
        print(
            f"{name}, steps {start}..{start + n} profiled: {sum(s.segments > 0 for s in win)} with a layer segment, "
            f"{sum(s.prompt_tokens for s in win)} prompt tokens, {sum(s.decodes for s in win)} decode rows"
        )
        print("\n".join(timeline.profiled.lines()))
        row["profile"] = timeline.profiled.as_dict()
    return row, timeline.steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_replay_args(p)
    add_workload_args(p)
    p.add_argument(
        "--configs",
        nargs="+",
        default=["dense", "layerseg_async"],
        type=_config_spec,
        metavar="NAME[:KEY=VALUE,...]",
        help=f"configs, one after the other ({', '.join(CONFIGS)}), each with engine arguments of its own, e.g. "
        "kvoffload_async:segment_decode_steps=1",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine argument for every config (repeatable), e.g. host_kv_memory=88GB",
    )
    p.add_argument(
        "--fresh-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run each config in a Python process of its own (a fresh server's memory, caches and allocator)",
    )
    p.add_argument(
        "--gauges-every",
        type=int,
        default=0,
        metavar="N",
        help="sample the engine's gauges every N steps (where the device budget sits; 0: none)",
    )
    p.add_argument(
        "--profile-window",
        nargs=2,
        type=int,
        default=None,
        metavar=("START", "N"),
        help="torch-profile steps [START, START + N) of each config: the GPU's critical path by kind of work and "
        "the blocking host calls with their callers (slows those steps)",
    )
    p.add_argument(
        "--profile-trace",
        default=None,
        metavar="DIR",
        help="with --profile-window: also write each config's Chrome trace of the window to DIR/CONFIG.trace.json.gz",
    )
    p.add_argument(
        "--profile-stack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --profile-window: record Python frames (the blocking calls' callers); --no-profile-stack adds far "
        "less host time a launch, so the GPU idle it reports is close to the unprofiled run's (host-bound steps)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.gauges_every < 0:
        p.error(f"--gauges-every must be >= 0, got {args.gauges_every}")
    logging.basicConfig(level=logging.INFO)
    if args.fresh_process:
        runs: dict[str, tuple[dict, list[StepRecord]]] = {}
        for c in args.configs:
            runs[c] = run_in_process(argv, c)
            save_report(args, runs)
        return report_runs(args, runs)
    from transformers import AutoTokenizer

    with model_dir(args) as model:
        tokenizer = AutoTokenizer.from_pretrained(model)
        jobs = workload_jobs(tokenizer, args)
        kw = engine_kwargs(args, args.max_input_len + max_output_len(args))
        kw.update(parse_engine_args(args.engine_arg))
        window = tuple(args.profile_window) if args.profile_window else None
        runs = {}
        for c in args.configs:
            runs[c] = run_config(model, c, jobs, kw, window, args.gauges_every, args.profile_trace, args.profile_stack)
            save_report(args, runs)
    return report_runs(args, runs)


def save_report(args: argparse.Namespace, runs: dict[str, tuple[dict, list[StepRecord]]]) -> None:
    """After each config: a run cut off by a time limit keeps the configs that finished."""
    if args.json:
        Path(args.json).write_text(json.dumps(build_report(args, runs), indent=2))


def run_in_process(argv: list[str], config: str) -> tuple[dict, list[StepRecord]]:
    """One config run by a child process of this module (the later --configs and --json override argv's)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "benchmarks.decode_time", *argv, "--no-fresh-process", "--configs", config]
        root = str(Path(__file__).resolve().parents[1])
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        subprocess.run([*cmd, "--json", str(out)], check=True, env=env)
        report = json.loads(out.read_text())
    row = report["rows"][0]
    steps = [
        StepRecord(**(s | {"requests": frozenset(s["requests"]), "prompt_work": tuple(map(tuple, s["prompt_work"]))}))
        for s in report["timelines"][config]
    ]
    return row, steps


def report_runs(args: argparse.Namespace, runs: dict[str, tuple[dict, list[StepRecord]]]) -> dict:
    """Prints the rows (and the ratios against dense) and returns the report."""
    rows = [row for row, _ in runs.values()]
    print_table(
        [{k: v for k, v in row.items() if k not in DETAIL} for row in rows],
        (
            f"longbench ({args.longbench_tokenizer} lengths), {args.num_requests} requests at {args.request_rate:g}/s"
            if args.dataset == "longbench"
            else f"conversation trace, first {args.num_requests} requests at time scale {args.time_scale:g}"
        )
        + (f", outputs of {args.output_len}" if args.output_len else "")
        + ": "
        "TPOT = decode + with_prefill + waiting (ms per output token)",
    )
    report = build_report(args, runs)
    if report["against_dense"]:
        print_table(report["against_dense"], "against dense in this call (TTFT: how many times lower)")
    return report


def build_report(args: argparse.Namespace, runs: dict[str, tuple[dict, list[StepRecord]]]) -> dict:
    """The JSON report of the configs run so far: rows, ratios against dense, timelines."""
    rows = [row for row, _ in runs.values()]
    return {
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "args": vars(args),
        "rows": rows,
        "against_dense": against(rows),
        "timelines": {
            c: [dataclasses.asdict(s) | {"requests": sorted(s.requests)} for s in steps]
            for c, (_, steps) in runs.items()
        },
    }


def against(rows: list[dict], base: str = "dense") -> list[dict]:
    """Each config's throughput, mean TTFT (times lower) and TPOT as ratios to `base` of the same call; [] without
    it (the issue's targets are such ratios)."""
    ref = next((r for r in rows if r["config"] == base), None)
    if ref is None:
        return []

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return [
        {
            "config": r["config"],
            "x_tok_s": ratio(r["output_tok_s"], ref["output_tok_s"]),
            "ttft_x_lower": ratio(ref["mean_ttft_s"], r["mean_ttft_s"]),
            "x_tpot": ratio(r["tpot_ms"], ref["tpot_ms"]),
        }
        for r in rows
    ]


if __name__ == "__main__":
    main()

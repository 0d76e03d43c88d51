"""Working-set-aware batch control (engine/scheduler.py, kvcache/working_set.py) on the CPU: the scheduler's rule
on its own (hold back the newest, never the last; held-back requests first back in; FCFS admission), and the
engine with an HBM pool far smaller than the working sets of all its requests: the batch shrinks, every request
finishes with the tokens of the unlimited run, nothing leaks; the counts the engine keeps equal a recount of the
selections it made; no request starves under arrivals; the statistics and /metrics."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve.config import EngineConfig, SchedulerConfig
from sparseserve.engine.engine import LLMEngine
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.metrics import ServerMetrics, parse_metrics
from sparseserve.sampling_params import SamplingParams
from tests.engine.sched_utils import LastSchedule, left, make_scheduler
from tests.engine.test_scheduler import DeviceSpace, run_step
from tests.kernel_utils import gpu_only
from tests.schedules import check_pool, held_blocks

BS = 8
ENGINE = dict(
    device="cpu",
    dtype="float32",
    max_model_len=256,
    max_num_seqs=6,
    max_num_batched_tokens=128,
    block_size=BS,
    sparse_policy="topk",
    sparse_budget=6 * BS,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_context=0,
    kv_offload=True,
)
# 64 head-block slots: one request's working set over 12 steps is ~30 of the tiny model's (2 layers x 2 KV
# heads x 4 listed blocks a step, and the lists change), six requests' ~180.
SMALL_POOL = dict(hbm_cache_blocks=64)


class FakeWorkingSet:
    enabled = True

    def __init__(self, limit: int, est: dict[int, int]) -> None:
        self.limit, self.est, self.records = limit, est, []

    def estimates(self, seqs):
        return [self.est[s.seq_id] for s in seqs]

    def due(self):
        return True

    def record(self, total, held, new_holds):
        self.records.append((total, held, new_holds))


class SpaceWithWorkingSet(DeviceSpace):
    def __init__(self, size: int, ws: FakeWorkingSet) -> None:
        super().__init__(size)
        self.working_set = ws


def seq(i: int, prompt_len: int = 6) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=50))


def test_scheduler_holds_back_the_newest_and_admits_first_come_first_served():
    ws = FakeWorkingSet(10, {0: 4, 1: 4, 2: 4, 3: 1})
    space = SpaceWithWorkingSet(100, ws)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockAllocator(64), BS, space)
    a, b, c, d = (seq(i) for i in range(4))
    for s in (a, b, c, d):
        sched.add(s)
    out = run_step(sched)  # 4 + 4 fit the limit of 10; c (4) does not, so d (1) waits behind it: FCFS
    assert [s for s, _ in out.scheduled] == [a, b] and list(sched.waiting) == [c, d]
    assert ws.records[-1] == (8, 2, 0)  # the limit stopped admission: both waiting ones count as held back
    ws.est.update({0: 6, 1: 6})  # the measured working sets grew: 12 > 10, the newest (b) is held back
    out = run_step(sched)
    assert out.held_back == [b] == left(out) and [s for s, _ in out.scheduled] == [a]
    assert space.paused == [1] and list(sched.waiting) == [b, c, d] and b.status is SequenceStatus.WAITING
    assert sched.num_preemptions == 0 and b.num_computed_tokens == 6 == b.num_tokens - 1  # paused, not preempted
    assert ws.records[-1] == (6, 3, 1)
    ws.est[0] = 30  # the last running sequence is never held back, whatever its working set
    out = run_step(sched)
    assert [s for s, _ in out.scheduled] == [a] and not out.held_back
    sched.finish(a)
    ws.est.update({1: 6, 2: 5})
    out = run_step(sched)  # b, held back, comes back first (into the empty batch), then c does not fit (11)
    assert [s for s, _ in out.scheduled] == [b] and list(sched.waiting) == [c, d]
    assert (b, 1) in out.scheduled  # resumed with a decode: nothing recomputed
    ws.enabled = False  # the control off: estimates still recorded, nobody waits for them
    out = run_step(sched)
    assert [s for s, _ in out.scheduled] == [b, c, d] and ws.records[-1][1:] == (0, 0)


def test_config_and_flags(capsys):
    """Working-set control is part of KV offload, not a switch: the old option is refused with the reason, by the
    LLM's keywords and the CLI; its tuning options remain."""
    cfg = EngineConfig.from_kwargs(working_set_window=4, working_set_margin=0.2, sparse_policy="topk", kv_offload=True)
    oc = cfg.offload_config
    assert (oc.working_set_control, oc.working_set_window, oc.working_set_margin) == (True, 4, 0.2)
    assert not EngineConfig.from_kwargs().offload_config.working_set_control  # nothing to control without offload
    for value in (True, False):
        with pytest.raises(TypeError, match="working_set_control' was removed: kv_offload always runs"):
            EngineConfig.from_kwargs(working_set_control=value)
    for flag in ("--working-set-control", "--no-working-set-control"):
        with pytest.raises(SystemExit) as e:
            build_parser(["generate"]).parse_args(["generate", flag])
        assert e.value.code == 2 and "thrashes" in capsys.readouterr().err
    args = build_parser(["generate"]).parse_args(
        ["generate", "--working-set-window", "8", "--working-set-margin", "0.05"]
    )
    kw = engine_kwargs_from_args(args)
    assert "working_set_control" not in kw and kw["working_set_window"] == 8 and kw["working_set_margin"] == 0.05
    for bad in (dict(working_set_window=0), dict(working_set_margin=1.0), dict(working_set_margin=-0.1)):
        with pytest.raises(ValueError, match="working_set"):
            EngineConfig.from_kwargs(**bad)


def make_engine(model, control: bool = True, **kw) -> LLMEngine:
    """An engine recording its last schedule. control=False turns the limit off inside the component (its estimates
    feed the gauges only): the thrashing reference that no accepted configuration gives."""
    engine = LLMEngine.from_kwargs(profiler=LastSchedule(), model=str(model), **kw)
    if not control:
        engine.scheduler.working_set.ws.enabled = False
    return engine


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (100 + 10 * i,), generator=g).tolist() for i in range(n)]


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], int]]], check=None) -> dict:
    """Steps until done, adding arrivals[step] before each step; returns each request's tokens and the most
    sequences a step ran. check(engine, the requests unfinished before the step) after every step."""
    tokens: dict[str, list[int]] = {}
    most, step = 0, 0
    while engine.has_unfinished_requests() or step <= max(arrivals, default=0):
        for rid, prompt, max_tokens in arrivals.get(step, []):
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        before = set(engine.requests)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        most = max(most, len(engine.profiler.out.scheduled))
        if check is not None:
            check(engine, before)
        step += 1
    return {"tokens": tokens, "most": most, "stats": engine.get_stats(sync=True)}


def assert_no_leaks(engine: LLMEngine) -> None:
    offload = engine.model_runner.offload
    held_blocks(engine)
    space = engine.scheduler.kv.device_space
    assert engine.allocator.num_used == 0 and space.map.allocator.num_used == 0
    check_pool(offload)
    state = engine.model_runner.attn_backend.state
    assert state.num_free_slots == state.num_slots and not state.held_slots() and state.num_stashed == 0
    assert space.working_set.num_tracked == 0


@pytest.mark.parametrize("lag", [0, 1])
def test_small_pool_shrinks_the_batch_with_the_same_tokens(tiny_model_dir, lag):
    """Six requests whose working sets need ~3x the pool: with the control the batch never holds more than the
    limit allows (one step late), runs fewer requests at once, hits the pool more, and every request finishes
    with the unlimited run's greedy tokens; no token block, device block, pool slot or state slot leaks. lag:
    lagged selection, whose lists the pool reads a step ahead; a held-back request resumes in a fresh state slot
    and selects its first list from its own query."""
    arrivals = {0: [(f"r{i}", p, 30) for i, p in enumerate(prompts())]}
    kw = {**ENGINE, **SMALL_POOL, "sparse_lag": lag}
    off = drive(make_engine(tiny_model_dir, control=False, **kw), arrivals)
    engine = make_engine(tiny_model_dir, **kw)
    ws = engine.scheduler.kv.device_space.working_set
    over = []

    def check(e, _):
        held_blocks(e)
        stats = e.get_stats()
        if stats.working_set_blocks > stats.working_set_limit:
            over.append(len(e.profiler.out.scheduled))

    on = drive(engine, arrivals, check)
    assert on["tokens"] == off["tokens"] and all(len(t) == 30 for t in on["tokens"].values())
    assert off["most"] == 6 and on["most"] < off["most"]
    assert set(over) <= {1}  # over the limit only with one request left running
    stats = engine.get_stats(sync=True)
    assert stats.working_set_hold_backs > 0 and stats.num_preemptions == 0
    assert stats.working_set_capacity == stats.offload_hbm_slots and stats.working_set_limit == int(0.9 * 64)
    assert ws.limit == stats.working_set_limit
    assert_no_leaks(engine)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    m = parse_metrics(text)
    assert m["sparseserve:working_set_hold_backs_total"] == stats.working_set_hold_backs
    assert m["sparseserve:working_set_capacity_blocks"] == 64 and "sparseserve:num_requests_held_back" in m
    assert "sparseserve:working_set_blocks" in m
    assert m["sparseserve:working_set_limit_blocks"] == stats.working_set_limit
    # the lists move from step to step: a whole window holds more than one step's list
    assert stats.working_set_growth > 1.0 and m["sparseserve:working_set_growth"] == stats.working_set_growth
    # The pool serves the smaller batch better (the point of the control).
    ratio = lambda s: s.offload_hbm_hits / (s.offload_hbm_hits + s.offload_blocks_loaded + s.offload_bypass_reads)  # noqa: E731
    assert ratio(stats) > ratio(off["stats"])


class Recount:
    """An observer of the sparse backend: the pool keys each decode row's lists asked for, per decode step, and
    the plain-Python union of each sequence's keys over the last `window` decode steps of its current slot."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.model_runner
        self.backend = self.runner.attn_backend
        self.offload = self.runner.offload
        self.window = engine.scheduler.kv.device_space.working_set.window
        self.steps: list[dict[int, set[int]]] = []  # per decode step: seq_id -> keys
        self.start: dict[int, int] = {}  # seq_id -> index of the decode step its current slot started at
        self.current: dict[int, set[int]] | None = None
        self.backend.observers.append(self.observe)

    def observe(self, layer, q, out, kv_cache, meta, scale) -> None:
        nd = meta.num_decodes
        if nd == 0 or layer < self.offload.dense_layers:
            return
        if self.current is None:
            self.current = {}
            self.steps.append(self.current)
        slots = meta.backend_meta.slots[:nd].long()
        # The lists the step read: with lagged selection its read rows (the slot's rows alternate), else the slots.
        rows = self.backend.step_rows[0][:nd].long() if self.backend.params.lag else slots
        key = self.offload.keys(layer, meta.block_tables[:nd], meta.seq_lens[:nd], self.backend.state.sel[layer][rows])
        by_slot = {slot: sid for sid, slot in self.backend.state.held_slots().items()}
        trash = self.offload.pool.trash_key
        for b, slot in enumerate(slots.tolist()):
            self.current.setdefault(by_slot[slot], set()).update(k for k in key[b].reshape(-1).tolist() if k != trash)

    def after_step(self) -> None:
        held = self.backend.state.held_slots()
        by_slot = {slot: sid for sid, slot in held.items()}
        for slot in self.backend.state.fresh:  # handed out at this step: history starts with it
            self.start[by_slot[slot]] = len(self.steps) - (1 if self.current is not None else 0)
        self.current = None
        counts = self.offload.working_set.counts().tolist()
        for sid, slot in held.items():
            lo = max(len(self.steps) - self.window, self.start[sid])
            union: set[int] = set()
            for step in self.steps[lo:]:
                union |= step.get(sid, set())
            assert counts[slot] == len(union), (sid, slot, counts[slot], len(union))


@pytest.mark.parametrize("control, window, lag", [(False, 12, 0), (True, 3, 0), (True, 3, 1)])
def test_engine_counts_equal_a_recount_of_its_selections(tiny_model_dir, control, window, lag, device="cpu"):
    """After every step each running sequence's device count is the union, recounted in Python, of the pool
    keys its lists asked for over the last `window` decode steps (since its slot was handed out: a held-back
    request resumes on a new slot); with arrivals, so sequences join and leave. lag: lagged selection, whose
    step reads the lists the step before selected (a resumed request's first ones selected in its step)."""
    engine = make_engine(
        tiny_model_dir,
        control,
        **{**ENGINE, "device": device},
        **SMALL_POOL,
        async_scheduling=False,  # the recount after every step reads that step's lists
        working_set_window=window,
        enforce_eager=True,
        sparse_lag=lag,
    )
    recount = Recount(engine)
    ps = prompts(5, seed=1)
    arrivals = {3 * i: [(f"r{i}", p, 12 + 3 * i)] for i, p in enumerate(ps)}
    drive(engine, arrivals, lambda e, _: recount.after_step())
    assert len(recount.steps) > 20
    assert_no_leaks(engine)


def test_no_starvation_under_arrivals(tiny_model_dir):
    """A request arrives every other step with a pool that holds about two working sets: every step runs the
    oldest unfinished request, every request finishes with the unlimited run's greedy tokens, and
    the hold-backs happened."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(2)
    arrivals = {
        2 * i: [(f"r{i}", torch.randint(10, 2000, (rng.randint(40, 160),), generator=g).tolist(), rng.randint(4, 24))]
        for i in range(14)
    }
    order = [rid for step in sorted(arrivals) for rid, _, _ in arrivals[step]]
    off = drive(make_engine(tiny_model_dir, control=False, **ENGINE, **SMALL_POOL), arrivals)
    engine = make_engine(tiny_model_dir, **ENGINE, **SMALL_POOL)

    def oldest_runs(e, before):
        unfinished = [rid for rid in order if rid in before]
        if unfinished:
            ran = {s.request_id for s, _ in e.profiler.out.scheduled}
            assert unfinished[0] in ran, (unfinished[0], ran)

    on = drive(engine, arrivals, oldest_runs)
    assert on["tokens"] == off["tokens"] and len(on["tokens"]) == len(order)
    assert engine.get_stats().working_set_hold_backs > 0
    assert_no_leaks(engine)


@gpu_only
def test_cuda_counts_and_graphs(tiny_model_dir):
    """On the GPU: the Triton count kernel inside eager steps equals the Python recount, and with decode steps
    replayed from CUDA graphs (the count captured in them, the counts read without a sync) the control shrinks
    the batch with the tokens of the unlimited run."""
    for control, window in ((False, 12), (True, 3)):
        test_engine_counts_equal_a_recount_of_its_selections(tiny_model_dir, control, window, 0, device="cuda")
    arrivals = {0: [(f"r{i}", p, 30) for i, p in enumerate(prompts())]}
    runs = {}
    for control in (False, True):
        kw = {**ENGINE, "device": "cuda", "async_scheduling": False}  # the batch each step ran: `most`
        engine = make_engine(tiny_model_dir, control, **kw, **SMALL_POOL)
        assert engine.model_runner.graphs is not None
        runs[control] = drive(engine, arrivals)
        assert_no_leaks(engine)
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["most"] < runs[False]["most"] and runs[True]["stats"].working_set_hold_backs > 0


class LandingSource:
    """A WorkingSetCounter stand-in: each `land` is one step's copy of the per-sequence counts."""

    cuda = False

    def __init__(self) -> None:
        self.landed: list[dict[int, int]] = []
        self.pending: dict[int, int] = {}

    def land(self, counts: dict[int, int]) -> None:
        self.landed.append(dict(counts))

    def poll(self) -> list[dict[int, int]]:
        out, self.landed = self.landed, []
        return out

    def drop(self, seq_id: int) -> None:
        for landed in self.landed:
            landed.pop(seq_id, None)


def test_new_requests_are_estimated_as_the_measured_windows_grew():
    """A request's first steps count only part of its window: before it has counted a whole window its estimate
    is at least one step's list times the growth the requests with a whole window showed (whole window over one
    list, a running mean), so admission does not take in what the next steps will hold back."""
    from sparseserve.kvcache.working_set import GROWTH_PRIOR, WorkingSetEstimate

    src = LandingSource()
    est = WorkingSetEstimate(
        src, window=3, capacity=1000, margin=0.0, enabled=True, lists=4, cap=6, local=1, block_size=BS
    )
    a, b = seq(0, prompt_len=20 * BS), seq(1, prompt_len=20 * BS)
    one_list = (6 - 1) * 4
    prior = int(one_list * GROWTH_PRIOR)  # nothing learned yet: above any growth measured (window 3 allows it)
    assert est.estimates([a, b]) == [prior, prior] and est.growth == GROWTH_PRIOR
    for count in (20, 28, 36):  # a's lists change: its window grows to 36 = 1.8 lists
        src.land({0: count})
        got = est.estimates([a, b])
    assert got == [36, int(one_list * 1.8)] and est.growth == pytest.approx(1.8)
    src.land({0: 30, 1: 20})  # a's next whole window is another sample (1.5); b's first count is below its
    assert est.estimates([a, b]) == [30, int(one_list * 1.65)]  # expected window: the expected one stands
    assert est.growth == pytest.approx((1.8 + 1.5) / 2)
    src.land({1: 50})
    assert est.estimates([b]) == [50]  # measured above the expectation: measured
    assert est.gauges()["working_set_growth"] == est.growth
    short = seq(2, prompt_len=4 * BS)  # a context within one list: it selects all of it, every step
    assert est.estimates([short]) == [(4 - 1) * 4]  # never more than every head block it has
    g = est.growth
    for _ in range(3):
        src.land({2: (4 - 1) * 4})
        est.estimates([short])
    assert est.growth == g  # nor does its whole window teach the growth anything
    est.on_pause(a)  # a paused: its estimate stands as the floor of its new slot until a whole window
    assert est.estimates([a]) == [max(30, int(one_list * est.growth))]


@pytest.mark.parametrize("prior", [1.0, None])
def test_the_first_requests_are_not_paused_mid_answer_before_the_growth_is_learned(tiny_model_dir, monkeypatch, prior):
    """Before any request has counted a whole window the growth is a prior above every growth measured, so a
    burst's first requests take decode shares at no less than their windows grow to: none is paused after its
    first tokens until the growth is learned (the tiny model's: ~1.9 lists). A prior of one list (the rule before,
    prior=1.0) let them all in and paused some mid-answer as their windows filled. Stickiness 1: lists that move
    enough for pauses after the growth is learned (the default's steadier lists fit their estimates here)."""
    import sparseserve.kvcache.working_set as W

    default = W.GROWTH_PRIOR
    if prior is not None:
        monkeypatch.setattr(W, "GROWTH_PRIOR", prior)
    engine = make_engine(tiny_model_dir, **{**ENGINE, "hbm_cache_blocks": 96, "sparse_stickiness": 1.0})
    est = engine.scheduler.kv.device_space.working_set
    start = est.growth
    paused_mid_answer, learned_at, step = [], None, 0

    def check(e, _):
        nonlocal learned_at, step
        step += 1
        if learned_at is None and est.growth != start:
            learned_at = step
        paused_mid_answer.extend(step for s in e.profiler.out.held_back if s.num_output_tokens > 1)

    arrivals = {0: [(f"r{i}", p, 30) for i, p in enumerate(prompts(6, seed=1))]}
    drive(engine, arrivals, check)
    assert learned_at is not None and 1.5 < est.growth < default
    early = [s for s in paused_mid_answer if s < learned_at]
    assert (len(early) > 0) if prior == 1.0 else (early == [] and paused_mid_answer), (learned_at, paused_mid_answer)
    assert_no_leaks(engine)


def test_a_pool_of_every_head_block_holds_nothing_back(tiny_model_dir):
    """Six requests whose lists name nearly their whole contexts, which nearly fill max_model_len: their working
    sets reach ~94% of every head block of the host store. A pool that holds every head block never evicts, so
    the limit is the whole pool (no margin) and all six decode at once; one block row short of that, the margin
    holds some back (the same tokens either way)."""
    g = torch.Generator().manual_seed(3)
    reqs = [(f"r{i}", torch.randint(10, 2000, (228 + i,), generator=g).tolist(), 20) for i in range(6)]
    kw = {**ENGINE, "sparse_budget": 30 * BS}
    probe = make_engine(tiny_model_dir, **kw)
    layout = probe.model_runner.offload.layout
    every = layout.token_blocks * 2 * 2  # 2 sparse layers x 2 KV heads
    del probe
    runs = {}
    for slots in (every, every - 4):
        engine = make_engine(tiny_model_dir, hbm_cache_blocks=slots, **kw)
        runs[slots] = drive(engine, {0: reqs})
        assert_no_leaks(engine)
    full, short = runs[every]["stats"], runs[every - 4]["stats"]
    assert full.working_set_capacity == every and full.working_set_limit == every
    assert full.working_set_hold_backs == 0 and runs[every]["most"] == 6
    assert short.working_set_capacity < every and short.working_set_limit == int(0.9 * short.working_set_capacity)
    assert short.working_set_hold_backs > 0
    assert runs[every]["tokens"] == runs[every - 4]["tokens"]

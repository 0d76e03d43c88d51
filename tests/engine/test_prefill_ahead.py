"""Prefill ahead under working-set-aware batch control (engine/scheduler.py, docs/working_set.md): the limit governs
decode, not prefill. The scheduler's rule on its own (a request that does not fit is prefilled, then parked until
its working set fits; decode shares in arrival order; the bound on prefilled waiting requests; a hold-back stops
no prefill admission, a real preemption does; aborting a parked request frees everything), and the engine with an
HBM pool far smaller than the working sets: greedy tokens equal the runs without the control and without prefill
ahead, every request's first token comes before any request finishes, the decode batch keeps to the limit, nothing
leaks; with layer-segmented prefill too."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve.config import EngineConfig, SchedulerConfig
from sparseserve.engine.engine import LLMEngine
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import Scheduler
from sparseserve.engine.scheduler.working_set import share_opens
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.metrics import ServerMetrics, parse_metrics
from sparseserve.sampling_params import SamplingParams
from tests.engine.sched_utils import left, make_scheduler
from tests.engine.test_scheduler import NO_RESERVE, DeviceSpace, run_step
from tests.engine.test_working_set import (
    ENGINE,
    SMALL_POOL,
    FakeWorkingSet,
    assert_no_leaks,
    drive,
    make_engine,
    prompts,
)

BS = 8


class AheadWorkingSet(FakeWorkingSet):
    def __init__(self, limit: int, est: dict[int, int]) -> None:
        super().__init__(limit, est)
        self.ahead_records: list[tuple[int, int]] = []

    def record_prefill_ahead(self, parked, new_ahead):
        self.ahead_records.append((parked, new_ahead))


class Space(DeviceSpace):
    def __init__(self, size: int, ws: FakeWorkingSet) -> None:
        super().__init__(size)
        self.working_set = ws


def seq(i: int, prompt_len: int = 6, max_tokens: int = 50) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


# A horizon that never binds: the tests of the other rules (arrival order, the bound, one at a time).
NO_HORIZON = 10**6


def make(
    est: dict[int, int],
    limit: int = 10,
    bound: int = 8,
    space: int = 100,
    blocks: int = 64,
    budget: int = 64,
    park: int = NO_HORIZON,
    **cfg,
) -> tuple[Scheduler, AheadWorkingSet, Space]:
    ws = AheadWorkingSet(limit, est)
    sp = Space(space, ws)
    sched = make_scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, **cfg),
        BlockAllocator(blocks),
        BS,
        sp,
        max_prefilled_waiting=bound,
        max_park_steps=park,
    )
    return sched, ws, sp


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def test_prefilled_ahead_then_parked_and_resumed_oldest_first():
    sched, ws, space = make({0: 4, 1: 4, 2: 4, 3: 1, 4: 3})
    a, b, c, d, e = (seq(i) for i in range(5))
    for s in (a, b, c, d, e):
        sched.add(s)
    out = run_step(sched)  # a + b fit the limit of 10; c does not: prefilled ahead; d and e wait behind it
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 6), (1, 6), (2, 6)]  # (one prefill ahead at a time)
    assert sched.working_set.ahead == {2} and ids(sched.waiting) == [3, 4] and ws.ahead_records[-1] == (0, 1)
    assert ws.records[-1] == (8, 3, 0)  # the decode shares' working sets; three requests wait for one
    # c's prefill is done (its first token sampled): it does not fit, so it is parked, and d prefills ahead.
    out = run_step(sched)
    assert ids(out.held_back) == [2] == ids(left(out)) and space.paused == [2]
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (3, 6)]
    assert sched.working_set.ahead == {3} and ids(sched.waiting) == [2, 4] and c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 6 == c.num_tokens - 1 and c.block_table  # everything computed is kept
    # d (1) would fit beside a and b, but c is older and waits: d is parked too (decode shares go in arrival
    # order), and e prefills ahead; then e is parked.
    out = run_step(sched)
    assert ids(out.held_back) == [3] and [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (4, 6)]
    out = run_step(sched)
    assert ids(out.held_back) == [4] and [s for s, _ in out.scheduled] == [a, b]
    assert list(sched.waiting) == [c, d, e] and all(s.status is SequenceStatus.WAITING for s in (c, d, e))
    assert sched.num_preemptions == 0 and not sched.working_set.ahead and ws.ahead_records[-1] == (3, 0)
    out = run_step(sched)  # nothing changed: they wait (and nothing is parked twice)
    assert [s for s, _ in out.scheduled] == [a, b] and not out.preempted and list(sched.waiting) == [c, d, e]
    sched.finish(a)  # room for c (4 + 4); then d (1) fits too (9); e (3) does not
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 1), (2, 1), (3, 1)]  # resumed with a decode
    assert list(sched.waiting) == [e] and ws.records[-1][0] == 9
    sched.finish(b)
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(2, 1), (3, 1), (4, 1)] and not sched.waiting


def test_decoding_sequences_are_never_parked_for_new_ones():
    """A new request's prefill ends with the batch full: the new one is parked, never one already decoding; and a
    decoding batch over the limit (measured working sets grew) parks its newest and keeps the oldest."""
    sched, ws, space = make({0: 5, 1: 5, 2: 2})
    a, b = seq(0), seq(1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)
    c = seq(2, prompt_len=30)
    sched.add(c)
    out = run_step(sched)  # 5 + 5 + 2 > 10: c prefills ahead beside the decodes
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (2, 30)] and sched.working_set.ahead == {2}
    ws.est[2] = 0  # even a sequence that fits waits behind nothing: it takes a share only when done
    out = run_step(sched)
    assert ids(out.held_back) == [] and not sched.working_set.ahead  # done, fits (10): it shares
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (2, 1)]
    ws.est.update({0: 9, 1: 9, 2: 9})  # over the limit: the newest decoding ones are parked, the oldest runs
    out = run_step(sched)
    assert ids(out.held_back) == [2, 1] and [s for s, _ in out.scheduled] == [a]
    assert list(sched.waiting) == [b, c]  # arrival order: b resumes before c
    sched.finish(a)
    out = run_step(sched)
    assert [s for s, _ in out.scheduled] == [b] and list(sched.waiting) == [c]


def test_a_prefill_over_the_limit_gives_back_its_share_without_pausing():
    """A sequence admitted with a decode share that is still prefilling when the working sets grow over the limit is
    not paused: it becomes ahead, and its decode share is decided when its prefill ends."""
    sched, ws, space = make({0: 4, 1: 4}, budget=16)
    a, b = seq(0), seq(1, prompt_len=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a (6) and 10 of b's 40 tokens
    assert not sched.working_set.ahead and b.num_computed_tokens == 10
    ws.est.update({0: 8, 1: 8})
    out = run_step(sched)
    assert not out.preempted and sched.working_set.ahead == {1} and b.num_computed_tokens == 25
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 15)]
    run_step(sched)
    assert b.num_computed_tokens == 40
    out = run_step(sched)  # b's prefill is done and it does not fit: parked
    assert ids(out.held_back) == [1] and list(sched.waiting) == [b] and space.paused == [1]


def test_bound_on_prefilled_waiting_requests():
    sched, ws, space = make({i: 6 for i in range(6)}, bound=2)
    seqs = [seq(i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)  # one fits; one prefills ahead; the rest wait unprefilled
    assert ids(s for s, _ in out.scheduled) == [0, 1] and sched.working_set.ahead == {1}
    assert ids(sched.waiting) == [2, 3, 4, 5] and ws.ahead_records[-1] == (0, 1)
    out = run_step(sched)  # 1 is parked, 2 prefills ahead: two prefilled waiting
    assert ids(out.held_back) == [1] and ids(s for s, _ in out.scheduled) == [0, 2] and sched.working_set.ahead == {2}
    out = run_step(sched)  # 2 is parked too: still two prefilled waiting, nobody else is admitted
    assert ids(out.held_back) == [2] and ids(sched.waiting) == [1, 2, 3, 4, 5]
    assert ids(s for s, _ in out.scheduled) == [0] and ws.ahead_records[-1] == (2, 0)
    sched.finish(seqs[0])
    out = run_step(sched)  # 1 resumes (a share), which frees a place: 3 prefills ahead
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 1), (3, 6)]
    assert sched.working_set.ahead == {3} and ids(sched.waiting) == [2, 4, 5] and ws.ahead_records[-1] == (1, 1)
    assert sched.working_set._share_queue().waiting == 2


def test_one_prefill_ahead_at_a_time():
    """A second request over the limit waits (unprefilled, and every request behind it) while one prefills ahead:
    prefill work stays first come first served instead of sharing the step among several."""
    sched, ws, space = make({0: 8, 1: 8, 2: 8, 3: 1}, budget=16)
    a, b, c, d = seq(0), seq(1, prompt_len=40), seq(2), seq(3)
    for s in (a, b, c, d):
        sched.add(s)
    out = run_step(sched)  # a fits; b goes ahead with 10 of its 40 tokens; c and d (which would fit) wait
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 6), (1, 10)] and ids(sched.waiting) == [2, 3]
    for _ in range(2):  # b's other chunks (15 tokens each beside a's decode)
        out = run_step(sched)
        assert [s.seq_id for s, _ in out.scheduled] == [0, 1] and ids(sched.waiting) == [2, 3]
    out = run_step(sched)  # b is done and parked; c prefills ahead now
    assert ids(out.held_back) == [1] and [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (2, 6)]


def test_hold_back_stops_no_prefill_but_a_preemption_does():
    # The decoding batch goes over the limit: b is held back, and the new request c is still admitted for prefill.
    sched, ws, space = make({0: 4, 1: 4, 2: 4})
    a, b = seq(0), seq(1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    c = seq(2)
    sched.add(c)
    ws.est.update({0: 6, 1: 6})
    out = run_step(sched)
    assert ids(out.held_back) == [1] and [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (2, 6)]
    assert sched.working_set.ahead == {2}
    # Token blocks run out (a real preemption): nothing is admitted in that step.
    sched, ws, space = make({0: 1, 1: 1, 2: 1}, blocks=4, **NO_RESERVE)
    a, b = seq(0, prompt_len=16), seq(1, prompt_len=16)  # two blocks each: all four taken
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.add(seq(2))
    out = run_step(sched)  # a's next token needs a block: b is preempted (no hold-back), c not admitted
    assert ids(left(out)) == [1] and not out.held_back and [s for s, _ in out.scheduled] == [a]
    assert ids(sched.waiting) == [1, 2]


def test_abort_of_a_parked_request_frees_everything():
    sched, ws, space = make({0: 8, 1: 8})
    a, b = seq(0), seq(1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)  # b parked
    assert list(sched.waiting) == [b] and b.block_table and 1 not in space.held
    sched.finish(b)  # the engine's abort
    assert not sched.waiting and b.block_table == [] and b.status is SequenceStatus.FINISHED
    sched.finish(a)
    assert sched.kv.allocator.num_used == 0 and space.held == {} and not sched.working_set.ahead
    sched.kv.allocator.check()


def test_without_control_or_bound_zero_nothing_changes():
    """max_prefilled_waiting=0, or the control off, schedules as before prefill ahead existed: a request that does
    not fit waits unprefilled and stops admission."""
    for bound, enabled in ((0, True), (8, False)):
        sched, ws, _ = make({0: 8, 1: 8, 2: 1}, bound=bound)
        ws.enabled = enabled
        for i in range(3):
            sched.add(seq(i))
        out = run_step(sched)
        expect = [0] if enabled else [0, 1, 2]
        assert ids(s for s, _ in out.scheduled) == expect and not sched.working_set.ahead and not ws.ahead_records


def test_share_opens():
    """When a sequence takes its decode share: decoding (steps left, need) end shortest first, the queue (need, steps
    it then decodes) takes shares in arrival order before the sequence, and an empty batch always takes one."""
    assert share_opens(4, [(9, 5)], [], 4) == 0  # fits now
    assert share_opens(0, [(9, 5), (3, 5)], [], 4) == 3  # the shorter decode ends first
    assert share_opens(0, [(9, 2), (3, 2)], [], 4) == 9  # one ending frees too little
    assert share_opens(0, [(9, 5), (3, 5)], [(5, 20)], 4) == 9  # an older one takes the first share
    assert share_opens(0, [(3, 5)], [(5, 20)], 4) == 23  # ... and decodes 20 steps before this one fits
    assert share_opens(-6, [(3, 4)], [], 20) == 3  # too big for the limit: when the batch empties
    assert share_opens(0, [], [], 4) == 0


def drive_steps(sched: Scheduler, arrivals: dict[int, list[Sequence]]) -> tuple[dict[int, int], dict[int, int]]:
    """run_step until every arrival has finished (at its max_tokens); the step of each sequence's first and second
    token."""
    firsts: dict[int, int] = {}
    seconds: dict[int, int] = {}
    step = 0
    while sched.has_unfinished() or step <= max(arrivals):
        for s in arrivals.get(step, []):
            sched.add(s)
        for s, _ in run_step(sched).scheduled:
            if s.num_output_tokens >= 1:
                firsts.setdefault(s.seq_id, step)
            if s.num_output_tokens >= 2:
                seconds.setdefault(s.seq_id, step)
        for s in list(sched.running):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s)
        step += 1
        assert step < 2000, "did not finish"
    return firsts, seconds


def parked_steps(firsts: dict[int, int], seconds: dict[int, int]) -> dict[int, int]:
    """Steps each sequence waited between its first and second token beyond the one step a decode takes."""
    return {i: seconds[i] - firsts[i] - 1 for i in seconds}


def test_prefill_ahead_only_for_a_slot_about_to_open():
    """Two decodes fill the limit for 20 and 40 more steps; c arrives: it is prefilled ahead only when a's share is
    about to open (its prefill ends at most `park` steps before), so its first and second tokens are at most `park`
    steps apart, yet its prefill ran before the share opened (it decodes at once). Without the horizon (the old
    rule) c is prefilled at once and waits parked ~20 steps between its first two tokens."""
    runs = {}
    for park in (3, NO_HORIZON):
        sched, ws, _ = make({0: 5, 1: 5, 2: 5}, park=park, budget=16)
        a, b, c = seq(0, max_tokens=21), seq(1, max_tokens=41), seq(2, prompt_len=40, max_tokens=30)
        runs[park] = drive_steps(sched, {0: [a, b], 1: [c]}), ws
    (firsts, seconds), ws = runs[3]
    assert parked_steps(firsts, seconds)[2] <= 3 and sum(n for _, n in ws.ahead_records) == 1  # c went ahead
    assert firsts[2] < 21 <= seconds[2]  # its first token before a ended (its prefill took 3 steps of 16 tokens)
    (firsts, seconds), ws = runs[NO_HORIZON]
    assert firsts[2] == 3 and parked_steps(firsts, seconds)[2] > 15


def test_random_arrivals_park_at_most_the_horizon():
    """Random arrivals, prompts of one to three steps' budget, max_tokens, and working sets (fixed): every sequence
    that was prefilled ahead waits at most `park` steps between its first two tokens (decodes end at their
    max_tokens, as predicted), prefill ahead still happens, every sequence finishes; without the horizon some wait
    far longer (the test fails on the old rule)."""
    worst = {}
    for park in (0, 4, NO_HORIZON):
        worst[park] = 0
        aheads = 0
        for seed in range(6):
            rng = random.Random(seed)
            arrivals: dict[int, list[Sequence]] = {}
            est = {}
            for i, step in enumerate(sorted(rng.randrange(0, 40) for _ in range(14))):  # ids in arrival order
                est[i] = rng.randint(2, 6)
                s = seq(i, prompt_len=rng.randint(4, 40), max_tokens=rng.randint(2, 40))
                arrivals.setdefault(step, []).append(s)
            sched, ws, _ = make(est, park=park, budget=16, blocks=512, space=1000)
            firsts, seconds = drive_steps(sched, arrivals)
            assert len(firsts) == 14 and not sched.has_unfinished()
            worst[park] = max([worst[park], *parked_steps(firsts, seconds).values()])
            aheads += sum(n for _, n in ws.ahead_records)
        assert aheads > 0, park
        if park != NO_HORIZON:
            assert worst[park] <= park, (park, worst[park])
    assert worst[NO_HORIZON] > 4 * 4


def test_config_and_flags():
    oc = EngineConfig.from_kwargs().offload_config
    assert (oc.max_prefilled_waiting, oc.max_park_steps) == (8, 8)
    args = build_parser(["serve"]).parse_args(["serve", "--max-prefilled-waiting", "0", "--max-park-steps", "2"])
    kw = engine_kwargs_from_args(args)
    assert (kw["max_prefilled_waiting"], kw["max_park_steps"]) == (0, 2)
    for bad in ("max_prefilled_waiting", "max_park_steps"):
        with pytest.raises(ValueError, match=bad):
            EngineConfig.from_kwargs(**{bad: -1})


# ---- the engine --------------------------------------------------------------------------------------------------


def engine(model, control: bool = True, **kw) -> LLMEngine:
    return make_engine(model, control, **{**ENGINE, **SMALL_POOL, **kw})


def watch(firsts: dict[str, int], finishes: dict[str, int], over: list, step_no: list[int], seconds=None):
    """A drive() check: the step of each request's first token (second token: into `seconds`, if given) and finish,
    and the decode rows of any step whose decode shares' working sets exceed the limit; also that no request without
    a decode share decodes."""

    def check(e: LLMEngine, before) -> None:
        sched = e.scheduler
        step_no[0] += 1
        for s, n in e.profiler.out.scheduled:
            if s.seq_id in sched.working_set.ahead:
                assert n > 1, "a request without a decode share decoded"
        for rid in before:
            req = e.requests.get(rid)
            seqs = req.seqs if req is not None else []
            if req is None or any(s.num_output_tokens for s in seqs):
                firsts.setdefault(rid, step_no[0])
            if seconds is not None and (req is None or any(s.num_output_tokens >= 2 for s in seqs)):
                seconds.setdefault(rid, step_no[0])
            if req is None:
                finishes.setdefault(rid, step_no[0])
        stats = e.get_stats()
        if stats.working_set_blocks > stats.working_set_limit:
            over.append(sum(1 for s, n in e.profiler.out.scheduled if n == 1))

    return check


def test_prefill_ahead_bounds_the_first_token_gap_and_decode_within_the_limit(tiny_model_dir):
    """Six requests whose working sets need ~3x the pool, arriving together: with prefill ahead (a horizon of 4 steps)
    a request is prefilled ahead only as its decode share is about to open, so none waits more than 4 steps between
    its first two tokens; without the horizon (the old rule, up to 16 ahead) every request got its first token before
    any finished and then waited parked for tens of steps; without prefill ahead the ones that do not fit wait
    unprefilled. The decode batch stays within the limit (over it only with one decode row); tokens equal the runs
    without the control and without prefill ahead; nothing leaks; the statistics and /metrics count it."""
    arrivals = {0: [(f"r{i}", p, 30) for i, p in enumerate(prompts())]}
    runs = {}
    for name, kw in (
        ("off", dict(control=False)),
        ("wait", dict(max_prefilled_waiting=0)),
        ("ahead", dict(max_park_steps=4)),
        ("unbounded", dict(max_park_steps=NO_HORIZON, max_prefilled_waiting=16)),
    ):
        e = engine(tiny_model_dir, **kw)
        firsts, seconds, finishes, over = {}, {}, {}, []
        runs[name] = drive(e, arrivals, watch(firsts, finishes, over, [0], seconds))
        runs[name].update(finishes=finishes, over=over, engine=e, firsts=firsts, parked=parked_steps(firsts, seconds))
        assert_no_leaks(e)
        assert not e.scheduler.working_set.ahead and not e.scheduler.waiting
        assert name == "off" or set(runs[name]["over"]) <= {0, 1}
        assert runs[name]["tokens"] == runs["off"]["tokens"]
    assert all(len(t) == 30 for t in runs["ahead"]["tokens"].values())
    assert max(runs["ahead"]["parked"].values()) <= 4
    assert max(runs["unbounded"]["firsts"].values()) < min(runs["unbounded"]["finishes"].values())
    assert max(runs["unbounded"]["parked"].values()) > 4 * 4  # what the horizon prevents
    assert max(runs["wait"]["firsts"].values()) > min(runs["wait"]["finishes"].values())
    stats = runs["ahead"]["engine"].get_stats(sync=True)
    assert stats.working_set_prefill_aheads > 0 and stats.working_set_hold_backs > 0 and stats.num_preemptions == 0
    assert stats.working_set_parked == 0  # a gauge: all done
    assert runs["wait"]["engine"].get_stats().working_set_prefill_aheads == 0
    m = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
    assert m["sparseserve:working_set_prefill_aheads_total"] == stats.working_set_prefill_aheads
    assert m["sparseserve:num_requests_parked"] == 0


def test_parked_gauge_and_abort_of_a_parked_request(tiny_model_dir):
    """Abort a request while it is parked (prefilled, paused): its blocks, device blocks and state go back; the other
    requests finish with the tokens of the run without the control."""
    arrivals = {0: [(f"r{i}", p, 20) for i, p in enumerate(prompts(5, seed=3))]}
    off = drive(engine(tiny_model_dir, control=False), arrivals)
    e = engine(tiny_model_dir)
    aborted = []

    def check(eng: LLMEngine, _) -> None:
        sched = eng.scheduler
        parked = [s for s in sched.waiting if sched.working_set._is_parked(s)]
        assert eng.get_stats().working_set_parked == len(parked)
        if parked and not aborted:
            aborted.append(parked[-1].request_id)
            eng.abort_request(parked[-1].request_id)
            assert parked[-1].block_table == [] and parked[-1] not in sched.waiting

    on = drive(e, arrivals, check)
    assert aborted
    assert_no_leaks(e)
    for rid, toks in off["tokens"].items():
        if rid != aborted[0]:
            assert on["tokens"][rid] == toks


def test_random_arrivals_same_tokens(tiny_model_dir):
    """Arrivals at random steps, random prompt and output lengths, three seeds: greedy tokens equal the run without
    the control and the run without prefill ahead; the decode batch keeps to the limit; nothing leaks."""
    for seed in range(3):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        arrivals: dict[int, list] = {}
        for i in range(10):
            arrivals.setdefault(rng.randrange(0, 30), []).append(
                (f"r{i}", torch.randint(10, 2000, (rng.randint(20, 200),), generator=g).tolist(), rng.randint(2, 30))
            )
        ref = drive(engine(tiny_model_dir, control=False), arrivals)["tokens"]
        for bound in (0, 2, 16):
            e = engine(tiny_model_dir, max_prefilled_waiting=bound)
            over: list = []
            run = drive(e, arrivals, watch({}, {}, over, [0]))
            assert run["tokens"] == ref, (seed, bound)
            assert set(over) <= {0, 1}
            assert_no_leaks(e)
            assert bound == 0 or e.get_stats().working_set_prefill_aheads > 0


def test_layer_segmented_prefill_ahead(tiny_model_dir):
    """Prompts longer than the step budget go through layer-segmented prefill (a layer a step: one layer of a prompt
    costs more than the budget); with prefill ahead they prefill beyond the limit and park at most the horizon:
    tokens equal the run without the control."""
    arrivals = {0: [(f"r{i}", p, 24) for i, p in enumerate(prompts(5, seed=4))]}
    # stickiness 1: lists that move enough to outgrow their estimates here (hold-backs); the default's fit them
    kw = dict(
        layer_segmented_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=0, sparse_stickiness=1.0
    )
    off = drive(engine(tiny_model_dir, control=False, **kw), arrivals)
    e = engine(tiny_model_dir, max_park_steps=2, **kw)
    segmented, seen, went_ahead = [], set(), set()
    firsts, seconds, finishes, over = {}, {}, {}, []
    inner = watch(firsts, finishes, over, [0], seconds)

    def check(eng: LLMEngine, before) -> None:
        inner(eng, before)
        out = eng.profiler.out
        segmented.extend(seg.seq.seq_id for seg in out.segments)
        for s in [s for s, _ in out.scheduled] + [seg.seq for seg in out.segments]:
            if s.seq_id not in seen and s.seq_id in eng.scheduler.working_set.ahead:
                went_ahead.add(s.request_id)  # admitted ahead (not given back its share later, when over the limit)
            seen.add(s.seq_id)

    on = drive(e, arrivals, check)
    assert segmented and on["tokens"] == off["tokens"]
    assert e.get_stats().working_set_prefill_aheads > 0 and e.get_stats().working_set_hold_backs > 0
    parked = parked_steps(firsts, seconds)
    assert went_ahead and max(parked[r] for r in went_ahead) <= 2 and set(over) <= {0, 1}
    assert_no_leaks(e)


def test_a_request_that_decoded_keeps_its_share_before_older_ones_that_did_not():
    """Decode shares go in share_order: requests that have decoded first, then the rest, each in arrival. A short
    prompt passes two long ones at admission (one long-prompt slot) and decodes; when the working sets grow, the
    long one still prefilling gives its share back (it goes on ahead, nothing paused) instead of the decoding short
    one being parked; when that one is parked later, it waits in front of the older long ones and resumes first.
    Before, decode shares went in arrival order alone: the short one was parked and waited behind every older long
    prompt, for as long as they took to prefill and decode (docs/working_set.md)."""
    ws = AheadWorkingSet(10, {0: 4, 1: 4, 2: 4, 3: 1})
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_long_partial_prefills=1)
    sched = make_scheduler(
        cfg,
        BlockAllocator(64),
        BS,
        Space(100, ws),
        long_prefill_token_threshold=16,
        max_prefilled_waiting=8,
        max_park_steps=NO_HORIZON,
    )
    a, l1, l2, s = seq(0), seq(1, prompt_len=40), seq(2, prompt_len=40), seq(3)
    for x in (a, l1, l2, s):
        sched.add(x)
    out = run_step(sched)
    assert [(x.seq_id, n) for x, n in out.scheduled] == [(0, 6), (1, 16), (3, 6)]  # s passes l2 (no long slot)
    run_step(sched)
    ws.est[3] = 3  # 4 + 4 + 3 > 10: l1, still prefilling, gives its share back; s keeps decoding
    out = run_step(sched)
    assert (s, 1) in out.scheduled and not out.held_back and sched.working_set.ahead == {1}
    out = run_step(sched)  # l1's prefill is done: no room, parked
    assert ids(out.held_back) == [1] and (s, 1) in out.scheduled
    ws.est[3] = 7  # a + s over the limit: s (the newest that decoded) is parked, in front of the older l1
    out = run_step(sched)
    assert ids(out.held_back) == [3] and ids(sched.waiting)[:2] == [3, 1]
    sched.finish(a)
    out = run_step(sched)  # room for s (7), not for l1 beside it (11): s resumes first
    assert (s, 1) in out.scheduled and l1 not in [x for x, _ in out.scheduled]
    assert sched.num_preemptions == 0

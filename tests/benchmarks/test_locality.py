"""benchmarks/locality.py on the CPU with a tiny model: the observer's device statistics equal a plain-Python recount of
the lists the backend made (overlap, Jaccard, union over the window), and the CLI writes its report."""

from __future__ import annotations

import json

import pytest

from benchmarks.locality import SelectionLocality, main, measure
from sparseserve.engine.engine import LLMEngine
from sparseserve.kernels.sparse_decode import listed_rows
from sparseserve.sampling_params import SamplingParams

BS = 8
SPARSE = dict(
    block_size=BS,
    sparse_policy="topk",
    sparse_budget=6 * BS,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
)


class PythonLists:
    """Every decode row's listed blocks per (layer, sequence, KV head) and step, as Python sets."""

    def __init__(self, backend) -> None:
        self.backend, self.lists = backend, {}

    def __call__(self, layer, q, out, kv_cache, meta, scale) -> None:
        nd = meta.num_decodes
        if nd == 0 or not self.backend.is_sparse(layer, meta):
            return
        p = self.backend.params
        slots = meta.backend_meta.slots[:nd].long()
        sel = self.backend.state.sel[layer][slots]
        listed = listed_rows(sel, meta.seq_lens[:nd], p.local, p.block_size)
        seq_of = {slot: sid for sid, slot in self.backend.state.held_slots().items()}
        for b, slot in enumerate(slots.tolist()):
            for h in range(sel.shape[1]):
                s = {int(x) for x, ok in zip(sel[b, h].tolist(), listed[b, h].tolist()) if ok}
                self.lists.setdefault((layer, seq_of[slot], h), []).append(s)

    def report(self, window: int) -> dict[int, tuple[float, float, float]]:
        acc: dict[int, list[list[float]]] = {}
        for (layer, _, _), steps in self.lists.items():
            a = acc.setdefault(layer, [[], [], []])
            for t, cur in enumerate(steps):
                if t >= 1 and cur:
                    a[0].append(len(cur & steps[t - 1]) / len(cur))
                    a[1].append(len(cur & steps[t - 1]) / len(cur | steps[t - 1]))
                if t + 1 >= window and cur:
                    win = steps[t + 1 - window : t + 1]
                    a[2].append(len(set().union(*win)) / max(sum(map(len, win)) / window, 1))
        return {layer: tuple(sum(v) / len(v) for v in a) for layer, a in acc.items()}


@pytest.mark.parametrize("window", [1, 4])
def test_observer_equals_a_python_recount(tiny_model_dir, window):
    engine = LLMEngine.from_kwargs(
        model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=3, **SPARSE
    )
    backend = engine.model_runner.attn_backend
    ref = PythonLists(backend)
    backend.observers.append(ref)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i, n in enumerate((150, 120, 90)):
        engine.add_request(f"r{i}", list(range(10 + i, 10 + i + n)), params)
    with SelectionLocality(backend, window, 256 // BS) as probe:
        while engine.has_unfinished_requests():
            engine.step()
    got = {r["layer"]: (r["overlap"], r["jaccard"], r[f"union_{window}"]) for r in probe.report()}
    expect = ref.report(window)
    assert got.keys() == expect.keys() == {0, 1}
    for layer in got:
        assert got[layer] == pytest.approx(expect[layer], rel=1e-9)
    assert all(0 < r["overlap"] <= 1 and 1 <= r[f"union_{window}"] <= window for r in probe.report())


def test_measure_and_cli(tiny_model_dir, tmp_path):
    res = measure(
        str(tiny_model_dir),
        prompt_len=200,
        batch=2,
        steps=16,
        budget=6 * BS,
        window=4,
        device="cpu",
        **{k: v for k, v in SPARSE.items() if k not in ("sparse_policy", "sparse_budget")},
    )
    assert [r["layer"] for r in res["layers"]] == [0, 1] and res["mean"]["listed"] > 0
    imp = res["implications"]
    assert imp["head_blocks_listed_per_request_step"] == pytest.approx(res["mean"]["listed"] * 2 * 2)  # layers x Hkv
    assert imp["working_set_head_blocks_per_request"] >= imp["head_blocks_listed_per_request_step"] * 0.999
    out = tmp_path / "loc.json"
    main(
        [
            "--model",
            str(tiny_model_dir),
            "--prompt-len",
            "120",
            "--batch",
            "1",
            "--steps",
            "6",
            "--budget",
            "48",
            "--window",
            "3",
            "--device",
            "cpu",
            "--engine-arg",
            "block_size=8",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["window"] == 3 and data["mean"]["layer"] == "mean" and "union_3" in data["mean"]

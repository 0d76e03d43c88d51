"""The package's shape: kernels/ is the bottom layer, the import graph between subpackages has no cycle, the KV
offload path is reached through one component, and a selection policy plugs in with one registration."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
import torch

import sparseserve
from sparseserve.attention.selection import DecodeRows, SelectionPolicy, SelectionState
from sparseserve.registry import SELECTION_POLICIES

PKG = Path(sparseserve.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every sparseserve module a file imports, at top level or lazily inside functions."""
    tree = ast.parse(path.read_text())
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.startswith("sparseserve"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sparseserve":
                mods.update(f"sparseserve.{a.name}" for a in node.names)
            elif node.module.startswith("sparseserve."):
                mods.add(node.module)
    return mods


def _unit(module: str) -> str:
    """The node of the graph a module belongs to: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sparseserve"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module in ("sparseserve", "sparseserve.__main__"):
            continue  # the public facade re-exports from the top
        src = _unit(module)
        for dep in _imports(path):
            dst = _unit(dep)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def test_kernels_import_nothing_above_them():
    above = ("attention", "kvcache", "engine", "models", "entrypoints", "layers", "bench", "config", "registry")
    for path in (PKG / "kernels").glob("*.py"):
        bad = {m for m in _imports(path) if _unit(m) in above}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_subpackage_import_graph_has_no_cycle():
    graph = _graph()
    assert graph.get("kernels", set()) <= set(), graph.get("kernels")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in list(graph):
        if node not in state:
            visit(node, [])


def test_kv_offload_is_reached_through_one_component():
    """Only the config, the offload cache itself and the runner's construction of it (and benchmarks) name
    the option."""
    out = subprocess.run(["grep", "-rn", "kv_offload", str(PKG)], capture_output=True, text=True).stdout
    allowed = ("config.py", "kvcache/offload.py", "bench/")
    hits = [line for line in out.splitlines() if not any(f"sparseserve/{a}" in line for a in allowed)]
    runner = [line for line in hits if "engine/runner.py" in line]
    assert len(runner) == 1 and "if config.offload_config.kv_offload" in runner[0], runner
    assert [line for line in hits if line not in runner] == []


def _all_imports(path: Path) -> set[str]:
    """Every module a file imports at run time (not under TYPE_CHECKING), sparseserve's or not."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    mods: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def test_scheduler_components_keep_their_boundaries():
    """The scheduler's side is plain Python over sequences and block ids: no torch, nothing of the runner,
    the attention backends or the worker side of KV offload. Policy components see the core only as a
    type, and the core reaches KV offload only through the device space it is given."""
    allowed = {
        "__future__",
        "collections",
        "dataclasses",
        "enum",
        "heapq",
        "math",
        "typing",
        "sparseserve.config",
        "sparseserve.engine.request",
        "sparseserve.kvcache.blocks",
        "sparseserve.kvcache.prefix_cache",
    }
    for path in (PKG / "engine" / "scheduler").glob("*.py"):
        mods = {m for m in _all_imports(path) if not m.startswith("sparseserve.engine.scheduler")}
        assert mods <= allowed, f"{path.name} imports {sorted(mods - allowed)}"
        if path.name not in ("scheduler.py", "__init__.py"):
            assert "sparseserve.engine.scheduler.scheduler" not in _all_imports(path), path.name


def test_offload_plan_separates_the_scheduler_side_from_the_workers():
    """kvcache/device_space.py (the scheduler's) and the plan touch no tensor and nothing of the worker side;
    the worker side (offload.py, host, pool, working-set counter) never imports the scheduler's."""
    scheduler_side = ("device_space.py", "offload_plan.py")
    for name in scheduler_side:
        mods = _all_imports(PKG / "kvcache" / name)
        assert "torch" not in mods and "numpy" not in mods, name
        assert mods <= {
            "__future__",
            "collections",
            "dataclasses",
            "typing",
            "sparseserve.kvcache.blocks",
            "sparseserve.kvcache.offload_plan",
        }, (name, mods)
    for path in (PKG / "kvcache").glob("*.py"):
        if path.name not in scheduler_side:
            assert "sparseserve.kvcache.device_space" not in _all_imports(path), path.name
    for path in PKG.rglob("*.py"):  # the engine's only way to the worker side is the runner
        if "engine" in path.parts and path.name not in ("runner.py", "kv_memory.py", "layer_prefill.py", "parallel.py"):
            bad = {m for m in _all_imports(path) if m in ("sparseserve.kvcache.offload", "sparseserve.kvcache.host")}
            assert not bad, (path, bad)


class RecentBlocks(SelectionPolicy):
    """A test-only policy: the most recent blocks of the context (the cap's worth), nothing scored."""

    def select(self, layer: int, q: torch.Tensor, rows: DecodeRows, state: SelectionState, key_meta) -> None:
        cap = self.params.cap
        nb = (rows.seq_lens.long() + self.params.block_size - 1) // self.params.block_size
        blocks = nb[:, None] - cap + torch.arange(cap, device=nb.device)[None]  # the last `cap` blocks
        lists = torch.where(blocks >= 0, blocks, -1).to(torch.int32)[:, None].expand(-1, state.sel.shape[2], -1)
        live = (rows.seq_lens > 0) & (rows.slots >= 0)
        state.sel[layer][rows.slots[live].long()] = lists[live]
        state.stats[0] += (lists[live] >= 0).sum()
        state.stats[1] += live.sum() * state.sel.shape[2]


@pytest.fixture
def recent_policy():
    SELECTION_POLICIES.register("recent")(RecentBlocks)
    yield "recent"
    SELECTION_POLICIES.unregister("recent")


@pytest.mark.slow
def test_a_policy_is_one_class_and_one_registration(tiny_model_dir, recent_policy):
    """The registered policy runs through the engine: with a budget covering the context it gives dense's
    tokens; with a small one each decode attends exactly its most recent blocks (the attention probe)."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.bench.attention_probe import AttentionProbe

    common = dict(device="cpu", block_size=8, max_model_len=160, max_num_seqs=2, enforce_eager=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (90, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(tiny_model_dir), **common, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm

    dense, _ = run()
    full, _ = run(sparse_policy=recent_policy, sparse_budget=160, sparse_dense_layers=0, sparse_dense_context=0)
    assert full == dense
    _, llm = run(
        sparse_policy=recent_policy,
        sparse_budget=32,
        sparse_dense_layers=0,
        sparse_dense_context=0,
        sparse_sink_blocks=0,
        sparse_local_blocks=1,
    )
    backend = llm.llm_engine.model_runner.attn_backend
    seen = []

    def check(layer, q, out, kv_cache, meta, scale):
        blocks = backend.attended_blocks(layer, meta)  # [B, Hkv, MB]
        nb = (meta.seq_lens[: meta.num_decodes] + 7) // 8
        for b, n in enumerate(nb.tolist()):
            want = torch.zeros(blocks.shape[-1], dtype=torch.bool)
            want[max(0, n - 4) : n] = True
            assert torch.equal(blocks[b, 0], want) and torch.equal(blocks[b, 1], want)
            seen.append(n)

    with AttentionProbe(backend):
        backend.observers.append(check)
        llm.generate(prompts, params, use_tqdm=False)
    assert max(seen) > 4  # contexts longer than the budget were checked
    with pytest.raises(ValueError, match="recent"):  # the config validates against the registry
        from sparseserve.config import EngineConfig

        SELECTION_POLICIES.unregister("recent")
        EngineConfig.from_kwargs(sparse_policy="recent")

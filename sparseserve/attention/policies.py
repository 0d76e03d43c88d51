"""The built-in block-selection policies (attention/selection.py has the interface).

topk: a fixed budget, the best blocks by their key bounds (kernels/block_score.py).
topp: Twilight's select-then-prune: topk picks `cap` candidates, then the fewest whose mass on
their real keys brings the list to sparse_top_p stay (kernels/topp_prune.py). Where the estimated
masses are flat (sparse_topp_flat_share) no mass target is in reach: the list takes
sparse_topp_flat_budget tokens and stays whole, the prune would drop little of it; with
sparse_topp_flat_hold H it is kept for the next H steps (selection and scoring skip it). Lagged, the
candidates come from the previous query and each step prunes them for its own, into a row of its
own (the candidates stay for the next selection). Under KV offload the candidates go through the HBM
pool (lagged: planned and loaded a step ahead, as topk's lists), so the prune reads their keys there.
"""

from __future__ import annotations

from typing import Any

import torch

from sparseserve.attention.selection import DecodeRows, SelectionPolicy, SelectionState
from sparseserve.kernels.block_score import score_and_select
from sparseserve.kernels.topp_prune import topp_prune
from sparseserve.registry import SELECTION_POLICIES


@SELECTION_POLICIES.register("topk")
class TopK(SelectionPolicy):
    defaults = {"sparse_budget": 2048}

    def select(self, layer: int, q: torch.Tensor, rows: DecodeRows, state: SelectionState, key_meta: Any) -> None:
        # topp's first stage is this topk: candidates, pruned in refine
        score_and_select(
            q,
            key_meta.codes,
            key_meta.scale,
            rows.tables,
            rows.seq_lens,
            rows.slots,
            state.sel[layer],
            state.counter[layer],
            self._select_stats(state),
            state.streaming[layer],
            max_blocks=rows.max_blocks,
            scale=rows.scale,
            width=rows.width,
            prev_slots=rows.prev_slots,
            ahead=rows.ahead,
            **self.params.kernel_args(),
            **self._flat_args(layer, rows, state),
        )

    def _select_stats(self, state: SelectionState) -> torch.Tensor:
        return state.stats

    def _flat_args(self, layer: int, rows: DecodeRows, state: SelectionState) -> dict[str, Any]:
        return {}


@SELECTION_POLICIES.register("topp")
class TopP(TopK):
    # Lagged: pruned lists fit the pruning query only, so each step prunes the candidates itself.
    prunes = True
    # candidates from the previous query lose answers (SmolLM2: -3.5 points, docs/benchmarks/accuracy.md)
    lags_by_default = False
    # the setting that keeps a spread-attention model's answers (SmolLM2 at 8K; blocks of 32 do not), flat lists
    # held (EngineConfig drops the hold where it cannot run or does not pay; docs/sparse.md, "topp's defaults")
    defaults = {"sparse_budget": 4096, "sparse_top_p": 0.99, "sparse_topp_flat_hold": 4, "block_size": 16}

    def _select_stats(self, state: SelectionState) -> torch.Tensor:
        # lagged, the step's prune counts what it keeps (kernels/topp_prune.py)
        return state.uncounted if self.params.lag else state.stats

    def _flat(self, layer: int, state: SelectionState) -> torch.Tensor | None:
        # flat lists take flat_cap blocks and skip the prune, which would drop little of them (docs/sparse.md)
        return state.flat[layer] if self.params.flat_share < 1.0 else None

    def _flat_args(self, layer: int, rows: DecodeRows, state: SelectionState) -> dict[str, Any]:
        flat = self._flat(layer, state)
        if flat is None:
            return {}
        p = self.params
        hold = dict(hold=p.flat_hold, hold_rows=rows.decodes) if p.flat_hold else {}
        return dict(
            flat=flat,
            flat_share=p.flat_share,
            flat_mass=p.top_p,
            flat_cap=p.flat_cap,
            flat_count=state.flat_lists,
            **hold,
        )

    def refine(
        self,
        layer: int,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: DecodeRows,
        state: SelectionState,
        offload: tuple | None,
        out: torch.Tensor | None = None,
        host_reads: torch.Tensor | None = None,
        **view_kw,
    ) -> bool:
        p, args = self.params, self.params.kernel_args()
        topp_prune(
            q,
            kv_cache,
            rows.cache_tables,
            rows.seq_lens,
            rows.slots,
            state.sel[layer],
            state.counter[layer],
            state.stats,
            sink=p.sink,
            local=p.local,
            top_p=p.top_p,
            scale=rows.scale,
            reuse=args["reuse"],
            short_dense=p.short_dense,
            per_head=p.per_head,
            offload=offload,
            host_reads=host_reads,
            out=out,
            flat=self._flat(layer, state),
            **view_kw,
        )
        return True

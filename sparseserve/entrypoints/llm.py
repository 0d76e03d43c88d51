"""Offline API, vLLM-compatible: LLM(model, **engine_args).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from sparseserve.engine.engine import LLMEngine
from sparseserve.outputs import RequestOutput
from sparseserve.profiler import Profiler
from sparseserve.sampling_params import ParameterError, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, profiler: Profiler | None = None, **engine_args) -> None:
        """profiler: optional hooks for benchmarks and probes (sparseserve/profiler.py)."""
        self.llm_engine = LLMEngine.from_kwargs(profiler, model=model, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                try:
                    engine.add_request(rid, prompt, p)
                except ParameterError as e:
                    if len(prompts) == 1:
                        raise
                    raise ParameterError(f"prompt {i}: {e}", e.param) from None
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # all or nothing: a bad prompt leaves no request behind
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        if not tok.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        # The template writes its own special tokens (BOS); encoding must not add a second one.
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        outputs: dict[str, RequestOutput] = {}  # the engine's deltas, folded
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for out in engine.step():
                    if out.request_id not in pending:
                        continue
                    if out.request_id in outputs:
                        outputs[out.request_id].add(out)
                    else:
                        outputs[out.request_id] = out
                    if out.finished:
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))  # e.g. Ctrl-C: free the blocks, keep the engine usable
            raise
        finally:
            bar.close()
        return [outputs[i] for i in ids]

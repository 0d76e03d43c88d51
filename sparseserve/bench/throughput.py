"""Offline generation throughput and decode step time, side by side with transformers' `generate`
on the same weights and prompts, against the HBM roofline measured in the same run.

    sparseserve bench throughput MODEL --input-lens 1024,8192 --output-len 256 --batch-sizes 1,16,32 \
        --hf-batch-sizes 1,4 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from sparseserve.bench.hardware import hbm_bandwidth, matmul_flops, print_table
from sparseserve.bench.steps import StepLog
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="Model directory (default: embedded model).")
    p.add_argument("--input-lens", type=_ints, default=[1024, 8192], help="Prompt lengths in tokens.")
    p.add_argument("--output-len", type=int, default=256, help="Generated tokens per request.")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 32], help="Concurrent requests (engine).")
    p.add_argument("--hf-batch-sizes", type=_ints, default=[], help="Batch sizes for transformers' generate.")
    p.add_argument(
        "--hf-input-lens", type=_ints, default=None, help="Prompt lengths for transformers (default: --input-lens)."
    )
    p.add_argument("--dtype", default="bfloat16", help="Model dtype.")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    p.add_argument("--max-num-batched-tokens", type=int, default=32768, help="Engine step token budget.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Engine GPU memory share.")
    p.add_argument("--enforce-eager", action="store_true", help="Disable CUDA graphs.")
    p.add_argument("--seed", type=int, default=0, help="Prompt seed.")
    p.add_argument("--json", help="Write results to this JSON file.")


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 32000), (batch, length), generator=g).tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, log: StepLog) -> dict:
    """One batch through `engine`, built with `log` as its profiler (StepLog(timing=True) for the GPU time)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.reset_prefix_cache()  # rows reuse prompts (one seed): each row prefills its own, as a cold engine would
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    gen0 = engine.num_generation_tokens
    decode_steps, graph_ms, t0, first_token_at = [], [], time.perf_counter(), None
    while engine.has_unfinished_requests():
        log.events.clear()
        ts = time.perf_counter()
        engine.step()  # ends in a host sync (sampled tokens to the CPU)
        te = time.perf_counter()
        # A step of the whole batch in decode: the decode step time that the roofline compares with.
        if log.last is not None and log.last.pure_decode(len(prompts)):
            decode_steps.append(te - ts)
            graph_ms += log.times_ms("graph")
        if first_token_at is None and engine.num_generation_tokens - gen0 >= len(prompts):
            first_token_at = te - t0  # every request has its first token: the batch's prefill is done
    total = time.perf_counter() - t0
    out = {
        "total_s": total,
        "prefill_s": first_token_at,
        "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
        "decode_step_mean_ms": 1e3 * statistics.fmean(decode_steps) if decode_steps else None,
        "output_tok_s": len(prompts) * output_len / total,
    }
    if graph_ms:
        # The decode forward alone (the graph replays' GPU time): the rest of a step is scheduling, sampling
        # and detokenization on the host.
        out["gpu_forward_ms"] = statistics.median(graph_ms)
    return out


def run_hf(model, prompts: list[list[int]], output_len: int, compile: bool) -> dict:
    """transformers' generate with a static cache; `compile` is its default for static caches (the
    first call compiles, so an identical call warms up), False is the same cache run eagerly."""
    ids = torch.tensor(prompts, device=model.device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=output_len, min_new_tokens=output_len)
    if model.device.type == "cuda":
        kw |= dict(cache_implementation="static", disable_compile=not compile)
    try:
        model.generate(ids if compile else ids[:, :16], **kw)  # warm-up
        _sync(model.device)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        _sync(model.device)
        total = time.perf_counter() - t0
        with torch.no_grad():
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            _sync(model.device)
            prefill = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        return {"total_s": "OOM"}
    finally:
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "total_s": total,
        "prefill_s": prefill,
        "decode_step_ms": 1e3 * (total - prefill) / (output_len - 1),
        "output_tok_s": len(prompts) * output_len / total,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight but the embedding table, plus the batch's KV."""
    model = engine.model_runner.model
    a = engine.model_runner.arch
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if a.tie_word_embeddings:
        weights += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    kv_per_token = a.num_layers * a.num_kv_heads * 2 * a.head_dim * engine.model_runner.dtype.itemsize
    return weights + batch * context * kv_per_token


def prefill_flops(engine: LLMEngine, tokens: int) -> float:
    """GEMM FLOPs (2 per weight per token, lm_head for one token) + causal attention (QK and PV)."""
    a = engine.model_runner.arch
    per_layer = (
        a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        + a.num_heads * a.head_dim * a.hidden_size
        + 3 * a.hidden_size * a.intermediate_size
    )
    gemm = 2 * tokens * a.num_layers * per_layer + 2 * a.hidden_size * a.vocab_size
    attn = 2 * a.num_layers * a.num_heads * a.head_dim * tokens * tokens  # 2 matmuls x 2 FLOPs x T^2/2
    return gemm + attn


def main(args: argparse.Namespace) -> None:
    max_len = max(args.input_lens) + args.output_len
    log = StepLog(timing=True)
    engine = LLMEngine.from_kwargs(
        log,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=max_len,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    dev = engine.model_runner.device
    result: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "model": engine.model_name,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    if dev.type == "cuda":
        result["hbm_bytes_per_s"] = hbm_bandwidth()
        result["matmul_flops"] = matmul_flops()
    vocab = engine.model_runner.arch.vocab_size
    capacity = engine.model_runner.num_blocks * engine.model_runner.block_size
    rows = []
    for length in args.input_lens:
        for batch in args.batch_sizes:
            row = {"engine": "sparseserve", "input": length, "batch": batch}
            if batch * (length + args.output_len) > capacity:
                rows.append(row | {"total_s": "KV too small"})
                continue
            r = run_engine(engine, make_prompts(batch, length, vocab, args.seed), args.output_len, log)
            if "hbm_bytes_per_s" in result and r["decode_step_ms"]:
                roof = decode_bytes(engine, batch, length + args.output_len // 2) / result["hbm_bytes_per_s"]
                r["roofline_ms"] = 1e3 * roof
                r["step/roofline"] = r["decode_step_ms"] / r["roofline_ms"]
            if batch == 1 and "matmul_flops" in result and r["prefill_s"]:
                r["prefill_mfu"] = prefill_flops(engine, length) / r["prefill_s"] / result["matmul_flops"]
            rows.append(row | r)
            print_table([rows[-1]])
    if args.hf_batch_sizes:
        model_dir = engine.model_runner.model_dir
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        from transformers import AutoModelForCausalLM

        hf = (
            AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=getattr(torch, args.dtype) if args.dtype != "auto" else "auto",
                attn_implementation="sdpa",
            )
            .to(dev)
            .eval()
        )
        for length in args.hf_input_lens or args.input_lens:
            for batch in args.hf_batch_sizes:
                for compile in (True, False) if dev.type == "cuda" else (False,):
                    r = run_hf(hf, make_prompts(batch, length, vocab, args.seed), args.output_len, compile)
                    name = "transformers" if compile or dev.type != "cuda" else "transformers-nocompile"
                    rows.append({"engine": name, "input": length, "batch": batch} | r)
                    print_table([rows[-1]])
    result["rows"] = rows
    for r in rows:  # side-by-side ratios at equal (input, batch)
        for peer_name, col in (
            ("transformers", "speedup_vs_hf"),
            ("transformers-nocompile", "speedup_vs_hf_nocompile"),
        ):
            peer = next(
                (
                    p
                    for p in rows
                    if p["engine"] == peer_name
                    and p["input"] == r["input"]
                    and p["batch"] == r["batch"]
                    and isinstance(p.get("total_s"), float)
                ),
                None,
            )
            if r["engine"] == "sparseserve" and peer and isinstance(r.get("output_tok_s"), float):
                r[col] = r["output_tok_s"] / peer["output_tok_s"]
    print_table(rows, f"throughput on {result['device']} ({result['model']})")
    if "hbm_bytes_per_s" in result:
        print(
            f"HBM {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {result['matmul_flops'] / 1e12:.0f} TFLOP/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_cli_args(ap)
    main(ap.parse_args())

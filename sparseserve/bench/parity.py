"""Engine vs transformers on the same weights: prompt-logit relative error and greedy agreement.

python -m sparseserve.bench.parity MODEL --dtype bfloat16 --prompt-len 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparseserve import LLM, SamplingParams
from sparseserve.bench.hardware import print_table
from sparseserve.engine.request import Sequence


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill through the model runner."""
    engine = llm.llm_engine
    runner = engine.model_runner
    seq = Sequence(-1, "parity", 0, prompt, SamplingParams(max_tokens=1))
    seq.block_table = engine.allocator.allocate(-(-len(prompt) // runner.block_size))
    try:
        batch = runner.prepare([(seq, len(prompt))])
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
            return runner.model.compute_logits(hidden)
    finally:
        engine.allocator.free(seq.block_table)


def main(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.prompt_len + args.max_tokens + 1,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    runner = llm.llm_engine.model_runner
    dev, dtype = runner.device, runner.dtype
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(100, min(runner.arch.vocab_size, 32000), (args.prompt_len,), generator=g).tolist()
    ours = prompt_logits(llm, prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    our_tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
        hf_tokens = hf.generate(
            ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    rel = ((ours - ref).norm() / ref.norm()).item()
    # transformers' own spread between two attention implementations: the bf16 noise floor.
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        eager = hf(ids).logits[0].float()
    floor = ((eager - ref).norm() / ref.norm()).item()
    # ... and the engine against eager too: within the spread means no farther from either than they are apart.
    rel_eager = ((ours - eager).norm() / eager.norm()).item()
    agree = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), len(our_tokens))
    row = {
        "model": llm.llm_engine.model_name,
        "dtype": str(dtype).removeprefix("torch."),
        "device": dev.type,
        "prompt_len": args.prompt_len,
        "logits_rel_err": rel,
        "logits_rel_err_vs_eager": rel_eager,
        "hf_eager_vs_sdpa_rel_err": floor,
        "argmax_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "greedy_tokens_equal_prefix": f"{agree}/{len(our_tokens)}",
    }
    print_table([row], f"parity vs transformers ({time.strftime('%Y-%m-%d')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return row


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="Model directory (default: embedded model).")
    p.add_argument("--dtype", default="auto", help="Model dtype.")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    p.add_argument("--prompt-len", type=int, default=512, help="Prompt length in tokens.")
    p.add_argument("--max-tokens", type=int, default=32, help="Greedy tokens compared.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="Leaves room for transformers' copy.")
    p.add_argument("--seed", type=int, default=0, help="Prompt seed.")
    p.add_argument("--json", help="Write the result to this JSON file.")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_cli_args(ap)
    main(ap.parse_args())

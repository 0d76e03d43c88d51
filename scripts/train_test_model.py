"""Train SparseServe's small long-context test model: a Llama (GQA, large RoPE base) in HF format.

Data: the essays (LM loss on natural text) and the RULER-style tasks of sparseserve/workloads/tasks.py
(loss on the answer tokens only), with a curriculum over lengths up to --max-len. The run prints its
loss curve, saves the checkpoint (bf16 safetensors + tokenizer.json with a chat template), then
reloads that checkpoint with transformers and prints exact-match accuracy per task and length.

    PYTHONPATH=. python scripts/train_test_model.py --data-dir ../shared/data/haystack --out .out/run
    (CPU smoke test: add --tiny)

Reproducible from --seed: the tokenizer, the model init and every batch derive from it; the schedule
is counted in steps. --time-limit only guards the device's 10-minute cap (it stops training early
and says so; the run is then reproducible with --steps set to the step it reached).
"""

from __future__ import annotations

import argparse
import os
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked
from sparseserve.workloads import tasks as T  # noqa: E402
from sparseserve.bench.accuracy import transformers_greedy  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# Renders messages as plain text after BOS: the model knows only the task format of tasks.py, so a
# chat turn is the whole prompt ("...\nQuestion: ...\nAnswer:").
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="essay folder (default: ../shared/data/haystack)")
    p.add_argument("--out", default=".out/run", help="output folder: trained_model/, state, logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2800)
    p.add_argument("--tokens-per-step", type=int, default=131072)
    p.add_argument("--max-len", type=int, default=32768, help="longest training sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=1_000_000.0)
    p.add_argument("--eval-lengths", default="4096,8192,16384,32768")
    p.add_argument("--eval-samples", type=int, default=50)
    p.add_argument("--eval-tasks", default=",".join(T.TASKS))
    p.add_argument("--eval-every", type=int, default=250, help="quick niah check every N steps (0: off)")
    p.add_argument("--time-limit", type=float, default=0, help="minutes of training before stopping early (0: none)")
    p.add_argument("--resume", default=None, help="an --out folder: state_fp32_*.safetensors, trained_model/")
    p.add_argument(
        "--curriculum-from",
        type=float,
        default=0.0,
        help="where in the length curriculum to start (0..1; for resumed runs)",
    )
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--extra-qa", type=int, default=8, help="extra questions per training sample (kv, multikey)")
    p.add_argument("--workers", type=int, default=12, help="batch-building processes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short lengths, few steps")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.tokens_per_step, args.max_len = min(args.steps, 30), 4096, 512
        args.vocab_size, args.hidden, args.layers, args.intermediate = 1024, 64, 2, 128
        args.eval_lengths, args.eval_samples, args.eval_every = "256,512", 4, 10
    return args


# -- tokenizer ----------------------------------------------------------------------------------
def task_strings(essays: list[str], rng: np.random.Generator, n: int = 1000) -> list[str]:
    """Texts in the task formats, so the BPE merges cover the templates, keys and variable names.
    Built with a byte-level tokenizer without merges: one token per byte, decodes to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    b = T.TaskBuilder(raw, essays[:3])
    out = []
    for i in range(n):
        s = b.build(T.TASKS[i % len(T.TASKS)], 1000, rng)
        out.append(s.prompt_text + " " + s.answer)
    return out


def train_tokenizer(essays: list[str], vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Digits one by one: numbers are copied digit by digit, and every key tokenizes alike.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = essays + task_strings(essays, np.random.default_rng([seed, 1]))
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)]
    )
    return tok


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", model_max_length=max_len
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    # Keep the template inside tokenizer_config.json (older loaders read it only there).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"], cfg["tokenizer_class"] = CHAT_TEMPLATE, "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        (out / extra).unlink(missing_ok=True)


# -- data ---------------------------------------------------------------------------------------
def phase_lengths(frac: float, max_len: int) -> tuple[list[int], list[float]]:
    """The curriculum: short sequences first (formats are learned cheaply), then long ones, and
    shorter lengths kept in the mix so they are not forgotten."""
    plan = [
        (0.2, {256: 0.5, 512: 0.5}),
        (0.3, {1024: 0.5, 2048: 0.5}),
        (0.45, {2048: 0.4, 4096: 0.6}),
        (0.65, {4096: 0.5, 8192: 0.5}),
        (1.01, {4096: 0.15, 8192: 0.25, 16384: 0.35, 32768: 0.25}),
    ]
    mix = next(m for end, m in plan if frac < end)
    mix = {min(n, max_len): w for n, w in mix.items()}  # --max-len caps the plan (tiny runs)
    return list(mix), [w / sum(mix.values()) for w in mix.values()]


def task_mix(frac: float) -> dict[str, float]:
    """Row kinds per phase. "copy" rows (a random token string, then the same string again, loss on
    the repeat) form induction heads early; without them the answer loss sat at chance for 2000
    steps (run 1, docs/accuracy.md). "lm" rows are essay text."""
    if frac < 0.06:  # pure copying first: the induction circuit every task below reuses
        return {"copy": 1.0}
    if frac < 0.2:
        return {"copy": 0.4, "passkey": 0.1, "niah_single": 0.05, "niah_multikey": 0.1, "kv_retrieval": 0.3, "lm": 0.05}
    return {
        "copy": 0.1,
        "passkey": 0.1,
        "niah_single": 0.2,
        "niah_multikey": 0.2,
        "kv_retrieval": 0.15,
        "variable_tracking": 0.15,
        "lm": 0.1,
    }


def make_batch(
    builder: T.TaskBuilder,
    seed: int,
    steps: int,
    tokens: int,
    max_len: int,
    eos: int,
    pad: int,
    curriculum_from: float,
    extra_qa: int,
    step: int,
) -> dict:
    rng = np.random.default_rng([seed, 2, step])
    frac = curriculum_from + (1 - curriculum_from) * step / steps
    lens, weights = phase_lengths(frac, max_len)
    length = int(rng.choice(lens, p=weights))
    rows = max(1, min(tokens // length, 128))  # short phases need fewer tokens (and CPU time)
    mix = task_mix(frac)
    names, probs = list(mix), np.array(list(mix.values()))
    vocab = builder.vocab_size
    seqs: list[list[int]] = []
    spans: dict[str, list[tuple[int, int, int]]] = {"ans": [], "lm": [], "copy": []}  # (row, from, to)
    for r in range(rows):
        kind = names[rng.choice(len(names), p=probs / probs.sum())]
        if kind == "lm":
            hay, _ = builder.essays.slice(rng, length - len(builder.bos))
            seqs.append(builder.bos + hay.tolist())
            # A random subset of positions keeps the LM logits cheap at long lengths.
            for t in rng.choice(length - 1, size=min(length - 1, 1024), replace=False):
                spans["lm"].append((r, int(t), int(t) + 1))
        elif kind == "copy":
            half = (length - len(builder.bos)) // 2
            rand = rng.integers(3, vocab, size=half).tolist()
            seqs.append(builder.bos + rand + rand)
            start = len(builder.bos) + half
            spans["copy"].append((r, start, start + half - 1))
        else:
            s = builder.build(kind, length, rng)
            seq = s.prompt_ids + s.answer_ids + [eos]
            spans["ans"].append((r, length - 1, len(seq) - 1))
            for q_ids, a_ids in builder.extra_qa(s, rng, extra_qa):
                seq += q_ids
                a0 = len(seq) - 1
                seq += a_ids + [eos]
                spans["ans"].append((r, a0, len(seq) - 1))
            seqs.append(seq)
    width = max(len(s) for s in seqs)
    ids = np.full((rows, width), pad, dtype=np.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    # Positions whose next token is supervised: [from, to) of each span.
    out = {"ids": ids, "length": length}
    for key, sp in spans.items():
        pos = [(r, t) for r, a, b in sp for t in range(a, b)]
        out[key] = np.array(pos, dtype=np.int64).reshape(-1, 2)
    return out


_WORKER: dict = {}


def _worker_batch(step: int) -> dict:
    return make_batch(_WORKER["builder"], *_WORKER["args"], step)


class BatchStream:
    """Batches built ahead by forked worker processes (the task generation is Python and would
    otherwise starve the GPU at short lengths). Batch `step` depends only on (seed, step)."""

    def __init__(self, builder, args_tuple: tuple, steps: int, workers: int, ahead: int = 12) -> None:
        import multiprocessing as mp

        _WORKER.update(builder=builder, args=args_tuple)
        self.pool = mp.get_context("fork").Pool(workers)
        self.steps, self.ahead, self.next, self.pending = steps, ahead, 0, {}
        self._fill()

    def _fill(self) -> None:
        while self.next < self.steps and len(self.pending) < self.ahead:
            self.pending[self.next] = self.pool.apply_async(_worker_batch, (self.next,))
            self.next += 1

    def get(self, step: int) -> dict:
        batch = self.pending.pop(step).get()
        self._fill()
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}

    def close(self) -> None:
        self.pool.terminate()


# -- model --------------------------------------------------------------------------------------
def build_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        # Trained up to --max-len; the table is larger so that an engine's max_model_len can hold a
        # max-length prompt plus its answer (RoPE is computed, not learned).
        max_position_embeddings=max(2 * args.max_len, 65536),
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        initializer_range=0.02,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def check_sdpa_gqa(device: str) -> None:
    """transformers asks SDPA for native GQA when there is no mask; if the fused kernels of this torch
    refuse that, SDPA silently falls back to the O(L^2)-memory math kernel. Test once; else repeat KV."""
    if device != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 8, 256, 32, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 256, 32, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        print("sdpa: fused kernel supports enable_gqa")
    except RuntimeError:
        import transformers.integrations.sdpa_attention as sa

        sa.use_gqa_in_sdpa = lambda *a, **k: False
        print("sdpa: no fused GQA kernel; repeating KV heads instead")


LOSS_WEIGHTS = {"ans": 1.0, "copy": 0.5, "lm": 0.3}


def loss_fn(model, batch: dict, device: str) -> tuple[torch.Tensor, dict[str, float]]:
    ids = batch["ids"].to(device)
    h = model.model(input_ids=ids).last_hidden_state  # logits only where a loss is taken
    total, parts = 0.0, {}
    for key, w in LOSS_WEIGHTS.items():
        pos = batch[key].to(device)
        if len(pos) == 0:
            parts[key] = float("nan")
            continue
        logits = model.lm_head(h[pos[:, 0], pos[:, 1]]).float()
        loss = F.cross_entropy(logits, ids[pos[:, 0], pos[:, 1] + 1])
        total = total + w * loss
        parts[key] = loss.item()
    return total, parts


def preflight(model, args, dev: str) -> None:
    """One forward/backward at the longest shape before training: an out-of-memory or kernel problem
    shows in the first seconds of a device call, not at its end."""
    rows = max(1, min(args.tokens_per_step // args.max_len, 64))
    ids = torch.randint(3, model.config.vocab_size, (rows, args.max_len + 32), device=dev)
    t = time.time()
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        h = model.model(input_ids=ids).last_hidden_state
    h[:, -64:].float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    if dev == "cuda":
        torch.cuda.synchronize()
        print(
            f"preflight {rows}x{args.max_len}: {time.time() - t:.2f}s, "
            f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
            flush=True,
        )


def lr_at(step: int, steps: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


# -- evaluation ---------------------------------------------------------------------------------
def greedy(model, prompts: torch.Tensor, max_new: int, eos: int) -> list[list[int]]:
    """Greedy answers, cut at EOS."""
    return [row[: row.index(eos)] if eos in row else row for row in transformers_greedy(model, prompts, max_new)]


def evaluate(model, builder, tok, tasks, lengths, n, seed, eos, device, batch_tokens=1 << 20):
    """Exact-match accuracy per (task, length) on the harness's samples (same seeds as `sparseserve
    bench accuracy --seed`)."""
    acc, answers = {}, {}
    for task in tasks:
        for length in lengths:
            samples = [builder.build(task, length, T.sample_rng(seed, task, length, i)) for i in range(n)]
            max_new = max(len(s.answer_ids) for s in samples) + 2
            rows = max(1, batch_tokens // length)
            got = []
            for i in range(0, n, rows):
                chunk = torch.tensor([s.prompt_ids for s in samples[i : i + rows]], device=device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    got += greedy(model, chunk, max_new, eos)
            texts = [tok.decode(g, skip_special_tokens=True) for g in got]
            acc[(task, length)] = float(np.mean([T.is_correct(t, s.answer) for t, s in zip(texts, samples)]))
            answers[(task, length)] = texts
    return acc, answers


def print_table(acc: dict, tasks, lengths, title: str) -> None:
    print(f"\n{title}")
    print(f"{'task':<20}" + "".join(f"{n:>8}" for n in lengths))
    for t in tasks:
        print(f"{t:<20}" + "".join(f"{100 * acc[(t, n)]:>7.1f}%" for n in lengths))


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    dev = args.device
    out = Path(args.out)
    model_dir = out / "trained_model"
    model_dir.mkdir(parents=True, exist_ok=True)
    essays = T.load_essays(T.find_haystack_dir(args.data_dir))
    from tokenizers import Tokenizer

    tok = (
        Tokenizer.from_file(str(Path(args.resume) / "trained_model" / "tokenizer.json"))
        if args.resume
        else train_tokenizer(essays, args.vocab_size, args.seed)
    )
    eos, pad = tok.token_to_id("<|eos|>"), tok.token_to_id("<|pad|>")
    builder = T.TaskBuilder(tok, essays, eos_id=eos)
    print(
        f"tokenizer: {tok.get_vocab_size()} tokens; essays {len(builder.essays.ids)} tokens ({time.time() - t0:.1f}s)"
    )

    model = build_model(args, tok)
    if args.resume:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(args.resume).glob("state_fp32_*.safetensors")):
            state.update(load_file(str(f)))
        print("resumed:", model.load_state_dict(state, strict=False))
    model.to(dev)
    check_sdpa_gqa(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M params ({2 * n_params / 2**20:.1f} MiB in bf16), "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} q / {args.kv_heads} kv heads"
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=dev == "cuda",
    )

    for _ in range(3):  # halve the step's tokens if the longest shape does not fit in memory
        try:
            preflight(model, args, dev)
            break
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            args.tokens_per_step //= 2
            print(f"preflight out of memory: --tokens-per-step {args.tokens_per_step}", flush=True)
    stream = BatchStream(
        builder,
        (args.seed, args.steps, args.tokens_per_step, args.max_len, eos, pad, args.curriculum_from, args.extra_qa),
        args.steps,
        args.workers,
    )
    log, t_train, hist = [], time.time(), {}
    step = 0
    for step in range(args.steps):
        batch = stream.get(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        model.train()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss, parts = loss_fn(model, batch, dev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for k, v in parts.items():
            hist.setdefault(k, []).append(v)
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            rec = {
                "step": step,
                "len": batch["length"],
                "lr": lr_at(step, args.steps, args.lr),
                "elapsed_s": round(el, 1),
            }
            with np.errstate(all="ignore"):
                rec.update(
                    {
                        f"{k}_loss": float(np.nanmean(v[-25:])) if not np.all(np.isnan(v[-25:])) else None
                        for k, v in hist.items()
                    }
                )
            log.append(rec)
            losses = " ".join(f"{k} {rec[f'{k}_loss']:.3f}" if rec[f"{k}_loss"] is not None else f"{k} -" for k in hist)
            print(f"step {step:5d} len {batch['length']:6d} {losses} lr {rec['lr']:.2e} {el:6.1f}s", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            model.eval()
            n = batch["length"]
            acc, _ = evaluate(
                model,
                builder,
                tok,
                ["passkey", "niah_single", "niah_multikey", "kv_retrieval"],
                [n],
                16,
                args.seed + 999,
                eos,
                dev,
            )
            print(f"  quick eval @ {n}: " + ", ".join(f"{k[0]} {100 * v:.0f}%" for k, v in acc.items()), flush=True)
        if args.save_every and step and step % args.save_every == 0:
            save_fp32(model, out)  # what comes back if the device's time limit kills the run
        if args.time_limit and time.time() - t_train > args.time_limit * 60:
            print(f"STOPPED EARLY by --time-limit at step {step} (of {args.steps})", flush=True)
            break
    stream.close()
    train_s = time.time() - t_train
    print(f"trained {step + 1} steps in {train_s:.0f}s")

    # Save: bf16 HF checkpoint (what ships) and the fp32 weights (to resume), each file < 16 MB.
    model.eval()
    save_fp32(model, out)
    save_checkpoint(model, tok, model_dir, args)
    results = {"args": vars(args), "log": log, "steps_done": step + 1, "train_s": train_s}
    (out / "results.json").write_text(json.dumps(results, indent=1))

    # Final accuracy: the saved bf16 checkpoint, reloaded through transformers.
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf_model = hf_model.to(dev).eval()
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    assert hf_tok("The pass key is 123")["input_ids"] == tok.encode("The pass key is 123").ids
    tasks = args.eval_tasks.split(",")
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    acc, answers = evaluate(hf_model, builder, tok, tasks, lengths, args.eval_samples, args.seed, eos, dev)
    print_table(
        acc, tasks, lengths, f"dense accuracy, transformers, bf16, {args.eval_samples} samples, seed {args.seed}"
    )
    results.update(
        accuracy={f"{t}@{n}": a for (t, n), a in acc.items()},
        examples={f"{t}@{n}": v[:3] for (t, n), v in answers.items()},
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"total {time.time() - t0:.0f}s")


def save_checkpoint(model, tok, model_dir: Path, args) -> None:
    from transformers import GenerationConfig
    import copy

    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the fp32 master weights stay untouched
    bf16.config.dtype = "bfloat16"
    bf16.save_pretrained(model_dir, safe_serialization=True)
    save_tokenizer(tok, model_dir, model.config.max_position_embeddings)  # the engine's default max_model_len
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    ).save_pretrained(model_dir)
    size = sum(f.stat().st_size for f in model_dir.iterdir()) / 2**20
    print(f"saved {model_dir} ({size:.1f} MiB): {sorted(f.name for f in model_dir.iterdir())}")


def save_fp32(model, out: Path) -> None:
    """fp32 weights in two shards (the device tool returns files of at most 16 MiB)."""
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    parts: list[dict] = [{}, {}]
    total, acc = sum(v.numel() for v in state.values()), 0
    for k in sorted(state):  # split by size, not by count
        parts[int(acc >= total / 2)][k] = state[k]
        acc += state[k].numel()
    for i, part in enumerate(parts):
        save_file(part, str(out / f"state_fp32_{i}.safetensors"))


if __name__ == "__main__":
    main()

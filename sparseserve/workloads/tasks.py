"""RULER-style long-context retrieval tasks, built at an exact token length from a seed.

Shared by the training script (scripts/train_test_model.py) and the accuracy harness
(sparseserve/bench/accuracy.py), so the model is evaluated on exactly the format it was trained on.

Every prompt is plain text: an instruction line, a haystack with needles at sentence boundaries,
then "\\nQuestion: ...\\nAnswer:". The expected completion is " " + answer, then EOS; scoring is
exact match on the first line of the generated text (`is_correct`).

Prompts are assembled in token space: each text piece is tokenized on its own and the ids are
concatenated. That makes every prompt exactly `length` tokens long (the haystack is cut to fit)
and makes generation cheap enough to run inside the training loop. Pieces start with a space
or a newline, so the ids equal those of the joined text for byte-level BPE tokenizers up to the
cut, and `TaskSample.prompt_text` gives that text for display.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

TASKS = ("passkey", "niah_single", "niah_multikey", "kv_retrieval", "variable_tracking")
DEFAULT_HAYSTACK_DIRS = ("../shared/data/haystack", ".out/data/haystack")

# Keys of the needle tasks: concrete nouns, so a question reads naturally ("the lantern").
KEY_WORDS = """
anchor apple arrow badge bakery balloon banana barrel basket beacon bicycle blanket bottle bracelet
bridge bucket button cabin camera candle canoe canvas carpet castle cellar chair chimney clock
compass cookie cottage crayon crystal cushion diamond dolphin donkey drawer dragon eagle engine
feather fence ferry fiddle flag flute forest fountain garden garlic giraffe glacier glove goblet
guitar hammer harbor helmet hammock island jacket jigsaw kettle kitten ladder lantern lemon
library lighthouse lizard locket magnet mango marble meadow mirror monkey mountain mushroom
necklace needle notebook oven paddle palace panther parrot peach pencil pepper piano pillow
pirate planet pocket pony pumpkin puzzle quilt rabbit radio raft ribbon river robot rocket saddle
sailboat satellite scarf scooter shovel skillet sled spider spoon squirrel stamp statue
submarine suitcase sunflower sweater teapot telescope tent thimble tiger tomato tractor trumpet
tulip turtle umbrella valley violin volcano wagon walnut wallet whistle window wizard yacht zebra
""".split()

# The filler of the passkey task: a few plain sentences repeated (the classic passkey setting).
PASSKEY_FILLER = (
    "The river runs down to the sea. The hills are green and quiet. The wind moves the leaves. The days come and go."
)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Ids of `text` without special tokens, for HF tokenizers and raw `tokenizers.Tokenizer` alike."""
    out = tok.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def leading_special_ids(tok: Any) -> list[int]:
    """The ids a tokenizer puts in front of plain text (BOS for Llama-style tokenizers), so that
    prompts given as ids match prompts given as strings."""
    out = tok.encode("a", add_special_tokens=True)
    full = list(out.ids) if hasattr(out, "ids") else list(out)  # raw tokenizers.Tokenizer or HF
    plain = encode(tok, "a")
    return full[: len(full) - len(plain)] if full[len(full) - len(plain) :] == plain else []


def normalize_answer(text: str) -> str:
    """The scored part of a generation: its first non-empty line, stripped."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def is_correct(generated: str, answer: str) -> bool:
    return normalize_answer(generated) == answer


def split_sentences(text: str) -> list[str]:
    """Sentences of an essay, whitespace collapsed. The essays' paragraph breaks were lost
    ("accelerating.We"), so a period glued to a capital also ends a sentence."""
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"(?<=[a-z][.!?])(?=[A-Z])", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def find_haystack_dir(explicit: str | None = None) -> Path:
    """The essays: an explicit path, else $SPARSESERVE_DATA_DIR/haystack or ../shared/data/haystack
    (from the repo root or the cwd), else .out/data/haystack (the copy that travels to the GPU machine)."""
    if explicit:
        path = Path(explicit)
        if not path.is_dir():
            raise FileNotFoundError(f"haystack directory not found: {path}")
        return path
    try:  # the benchmarks' data folder ($SPARSESERVE_DATA_DIR, else ../shared/data)
        from sparseserve.workloads.datasets import data_dir

        if (data_dir() / "haystack").is_dir():
            return data_dir() / "haystack"
    except ImportError:
        pass
    repo = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), repo):
        for rel in DEFAULT_HAYSTACK_DIRS:
            if (base / rel).is_dir():
                return base / rel
    raise FileNotFoundError("essay haystack not found: pass --data-dir (expected ../shared/data/haystack)")


# The needle demo's haystack when the essays are absent (a plain clone): noise in RULER's manner, short
# sentences that carry nothing to retrieve, generated from these word lists.
_NOISE_SUBJECTS = [
    ("grass", "green"),
    ("sky", "blue"),
    ("sun", "warm"),
    ("sea", "deep"),
    ("snow", "white"),
    ("night", "dark"),
    ("road", "long"),
    ("river", "slow"),
    ("stone", "grey"),
    ("wind", "cold"),
    ("field", "wide"),
    ("hill", "quiet"),
    ("morning", "still"),
    ("forest", "old"),
    ("lake", "calm"),
]
_NOISE_FORMS = [
    "The {0} is {1}.",
    "The {0} is {1} today.",
    "Here the {0} stays {1}.",
    "The {0} was {1} again.",
    "Far away, the {0} is {1}.",
    "Day after day the {0} is {1}.",
]


def builtin_filler(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    """One 'essay' of plain noise sentences ("The grass is green. The sky is blue today. ..."), about 8 tokens
    each, so 3000 cover a 16K haystack before the corpus wraps around."""
    rng = np.random.default_rng(seed)
    subjects = rng.integers(len(_NOISE_SUBJECTS), size=num_sentences)
    forms = rng.integers(len(_NOISE_FORMS), size=num_sentences)
    return [" ".join(_NOISE_FORMS[f].format(*_NOISE_SUBJECTS[s]) for s, f in zip(subjects, forms))]


def load_essays(data_dir: str | Path) -> list[str]:
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt essays in {data_dir}")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


@dataclass
class TaskSample:
    task: str
    length: int  # the prompt's exact length in tokens, BOS included
    prompt_ids: list[int]
    answer: str  # the exact-match target (no leading space)
    answer_ids: list[int]  # ids of " " + answer: the completion the model is trained on
    meta: dict = field(default_factory=dict)  # needle depths, keys: for reports and debugging
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def prompt_text(self) -> str:
        """The prompt as text (decoded on demand: decoding 32K tokens is not free)."""
        return decode(self.tokenizer, self.prompt_ids)


class TokenCorpus:
    """A token stream with sentence boundaries, sliced into haystacks of exact length."""

    def __init__(self, pieces: list[list[int]]) -> None:
        lens = np.array([len(p) for p in pieces], dtype=np.int64)
        self.ids = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=int(lens.sum()))
        self.starts = np.concatenate([[0], np.cumsum(lens)[:-1]])  # where each sentence begins

    def slice(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n tokens from a random sentence start (wrapping around), and the sentence starts in it."""
        total = len(self.ids)
        s = int(self.starts[rng.integers(len(self.starts))])
        reps = (s + n) // total + 1
        ids = np.tile(self.ids, reps)[s : s + n] if reps > 1 else self.ids[s : s + n]
        starts = np.concatenate([self.starts + r * total for r in range(reps)]) - s
        return ids, starts[(starts >= 0) & (starts < n)]


class TaskBuilder:
    """Builds `TaskSample`s for one tokenizer; tokenizes the essays once."""

    def __init__(self, tokenizer: Any, essays: list[str], eos_id: int | None = None) -> None:
        self.tok = tokenizer
        self.bos = leading_special_ids(tokenizer)
        self.vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)
        self.eos_id = eos_id
        sentences = [s for e in essays for s in split_sentences(e)]
        self.essays = TokenCorpus(self._encode_many([" " + s for s in sentences]))
        self.filler = TokenCorpus([self.enc(" " + s) for s in split_sentences(PASSKEY_FILLER)])
        self._cache: dict[str, list[int]] = {}

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if hasattr(self.tok, "encode_batch"):  # raw tokenizers.Tokenizer: parallel, fast
            return [list(e.ids) for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        return [list(x) for x in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def enc(self, text: str) -> list[int]:
        return encode(self.tok, text)

    def enc_cached(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.enc(text)
        return self._cache[text]

    def build(self, task: str, length: int, rng: np.random.Generator) -> TaskSample:
        if task not in GENERATORS:
            raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
        return GENERATORS[task](self, length, rng)

    def extra_qa(self, sample: TaskSample, rng: np.random.Generator, k: int) -> list[tuple[list[int], list[int]]]:
        """Up to k more (question ids, answer ids) about the same context (other needles or keys), for
        training only: they multiply the answer tokens a long sequence supervises. Drawn after the
        sample, so the sample itself does not depend on k."""
        pool = sample.meta.get("qa_pool", [])
        if not pool or k <= 0:
            return []
        pick = rng.choice(len(pool), size=min(k, len(pool)), replace=False)
        return [(self.enc(pool[i][0]), self.enc(" " + pool[i][1])) for i in pick]

    # -- assembly -------------------------------------------------------------------------------
    def assemble(
        self,
        task: str,
        length: int,
        prefix: str,
        hay: np.ndarray,
        starts: np.ndarray,
        needles: list[tuple[float, str]],
        question: str,
        answer: str,
        meta: dict,
    ) -> TaskSample:
        """bos + prefix + haystack (needles at the sentence starts nearest their depths) + question,
        with the haystack cut so that the whole prompt is exactly `length` tokens."""
        head = self.bos + self.enc_cached(prefix)
        tail = self.enc(question)
        needle_ids = [self.enc(text) for _, text in needles]
        room = length - len(head) - len(tail) - sum(len(n) for n in needle_ids)
        if room < 0:
            raise ValueError(f"length {length} is too short for task {task}")
        hay, starts = hay[:room], starts[starts <= room]
        if len(starts) == 0 or starts[-1] != room:
            starts = np.append(starts, room)  # the end of the haystack is a boundary too
        cuts = []
        for depth, _ in needles:  # the sentence boundary nearest the needle's depth
            cuts.append(int(starts[np.abs(starts - depth * room).argmin()]))
        order = np.argsort(cuts, kind="stable")  # needles keep their list order at one boundary
        parts: list[np.ndarray | list[int]] = [head]
        prev = 0
        for i in order:
            parts += [hay[prev : cuts[i]], needle_ids[i]]
            prev = cuts[i]
        parts += [hay[prev:], tail]
        ids = [int(t) for p in parts for t in p]
        assert len(ids) == length, (len(ids), length)
        meta = dict(meta, depths=[round(d, 3) for d, _ in needles])
        return TaskSample(
            task=task,
            length=length,
            prompt_ids=ids,
            answer=answer,
            answer_ids=self.enc(" " + answer),
            meta=meta,
            tokenizer=self.tok,
        )


# -- the tasks ---------------------------------------------------------------------------------
def _digits(rng: np.random.Generator, n: int) -> str:
    return str(int(rng.integers(10 ** (n - 1), 10**n)))


def passkey(b: TaskBuilder, length: int, rng: np.random.Generator) -> TaskSample:
    key = _digits(rng, 5)
    hay, starts = b.filler.slice(rng, length)
    needle = f" The pass key is {key}. Remember it: {key} is the pass key."
    return b.assemble(
        "passkey",
        length,
        "A pass key is hidden in the text below. Find it and remember it.\n",
        hay,
        starts,
        [(float(rng.random()), needle)],
        "\nQuestion: What is the pass key?\nAnswer:",
        key,
        {},
    )


def _niah(b: TaskBuilder, length: int, rng: np.random.Generator, task: str, num_keys: int) -> TaskSample:
    keys = [KEY_WORDS[i] for i in rng.choice(len(KEY_WORDS), size=num_keys, replace=False)]
    values = [_digits(rng, 7) for _ in keys]
    hay, starts = b.essays.slice(rng, length)
    needles = [(float(rng.random()), f" The secret number of the {k} is {v}.") for k, v in zip(keys, values)]
    q = int(rng.integers(num_keys))  # which key is asked for; the others are distractors
    return b.assemble(
        task,
        length,
        "Secret numbers are hidden in the essays below. Remember them: you will be asked for one of them.\n",
        hay,
        starts,
        needles,
        NIAH_QUESTION.format(keys[q]),
        values[q],
        {
            "keys": keys,
            "asked": keys[q],
            "depth": needles[q][0],
            "qa_pool": [(NIAH_QUESTION.format(k), v) for i, (k, v) in enumerate(zip(keys, values)) if i != q],
        },
    )


NIAH_QUESTION = "\nQuestion: What is the secret number of the {}?\nAnswer:"


def niah_single(b: TaskBuilder, length: int, rng: np.random.Generator) -> TaskSample:
    return _niah(b, length, rng, "niah_single", 1)


def niah_multikey(b: TaskBuilder, length: int, rng: np.random.Generator) -> TaskSample:
    return _niah(b, length, rng, "niah_multikey", 4)


def _hex(rng: np.random.Generator, n: int = 8) -> str:
    return "".join("0123456789abcdef"[i] for i in rng.integers(16, size=n))


def kv_retrieval(b: TaskBuilder, length: int, rng: np.random.Generator) -> TaskSample:
    """A long table of random hex keys and values, no essay: every line is a distractor."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    pieces: list[list[int]] = []
    while sum(len(p) for p in pieces) < length:  # enough lines; the assembly cuts the haystack to fit
        new = []
        for _ in range(max(8, (length - sum(len(p) for p in pieces)) // 12)):
            k, v = _hex(rng), _hex(rng)
            if k not in seen:
                seen.add(k)
                new.append((k, v))
        pairs += new
        pieces += b._encode_many([f"\n{k} = {v}" for k, v in new])
    # The haystack room, as `assemble` will compute it; question lengths differ by a token or two
    # between keys, hence the margin, so that the asked line is surely kept whole.
    question = "\nQuestion: What is the value of key {}?\nAnswer:"
    room = length - len(b.bos) - len(b.enc_cached(KV_PREFIX)) - len(b.enc(question.format(pairs[0][0]))) - 4
    ends = np.cumsum([len(p) for p in pieces])
    kept = max(1, int(np.searchsorted(ends, room, side="right")))
    q = int(rng.integers(kept))
    corpus = TokenCorpus(pieces)
    hay, starts = corpus.ids, corpus.starts
    return b.assemble(
        "kv_retrieval",
        length,
        KV_PREFIX,
        hay,
        starts,
        [],
        question.format(pairs[q][0]),
        pairs[q][1],
        {
            "num_pairs": kept,
            "asked_index": q,
            "qa_pool": [
                (question.format(pairs[i][0]), pairs[i][1])
                for i in rng.choice(kept, size=min(kept, 33), replace=False)
                if i != q
            ][:32],
        },
    )


KV_PREFIX = "Below is a table of keys and values. Find the value of the key asked for at the end."


def _var_name(rng: np.random.Generator) -> str:
    return "".join(chr(65 + i) for i in rng.integers(26, size=5))


def variable_tracking(b: TaskBuilder, length: int, rng: np.random.Generator, hops: int = 4) -> TaskSample:
    """A chain VAR A = 12345, VAR B = VAR A, ... spread through the essays, in order; the answer
    lists every variable that holds the value, in assignment order."""
    names: list[str] = []
    while len(names) < hops + 1:
        n = _var_name(rng)
        if n not in names:
            names.append(n)
    value = _digits(rng, 5)
    depths = np.sort(rng.random(hops + 1))
    texts = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    hay, starts = b.essays.slice(rng, length)
    return b.assemble(
        "variable_tracking",
        length,
        "Variables are assigned in the text below. Keep track of their values.\n",
        hay,
        starts,
        [(float(d), t) for d, t in zip(depths, texts)],
        f"\nQuestion: Which variables hold the value {value}? List them in the order they were assigned.\nAnswer:",
        " ".join(names),
        {"names": names},
    )


GENERATORS: dict[str, Callable[[TaskBuilder, int, np.random.Generator], TaskSample]] = {
    "passkey": passkey,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
}


def sample_rng(seed: int, task: str, length: int, index: int) -> np.random.Generator:
    """One independent stream per (seed, task, length, sample index): a sample does not change when
    other tasks, lengths or sample counts are added to a run."""
    return np.random.default_rng([seed, TASKS.index(task), length, index])


def build_suite(
    builder: TaskBuilder, tasks: list[str], lengths: list[int], num_samples: int, seed: int
) -> list[TaskSample]:
    return [builder.build(t, n, sample_rng(seed, t, n, i)) for t in tasks for n in lengths for i in range(num_samples)]


def _main(argv: list[str] | None = None) -> None:
    """Prints one task prompt as text (for a demo: `sparseserve generate --prompt "$(python -m
    sparseserve.workloads.tasks niah_single 4096)"`); the expected answer goes to stderr."""
    import argparse
    import sys
    from pathlib import Path

    p = argparse.ArgumentParser(description=_main.__doc__)
    p.add_argument("task", choices=TASKS)
    p.add_argument("length", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory whose tokenizer counts the tokens")
    p.add_argument("--data-dir", default=None)
    a = p.parse_args(argv)
    if a.model is None:  # the embedded model: its tokenizer.json alone, without importing torch or transformers
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(__file__).parents[1] / "models" / "default" / "tokenizer.json"))
    else:
        from sparseserve.models.loader import load_tokenizer, resolve_model_dir

        tok = load_tokenizer(resolve_model_dir(a.model))
    try:
        essays = load_essays(find_haystack_dir(a.data_dir))
    except FileNotFoundError as e:
        if a.data_dir:
            p.error(str(e))
        print(f"note: {e}; the haystack is the built-in filler sentences instead", file=sys.stderr)
        essays = builtin_filler()
    s = TaskBuilder(tok, essays).build(a.task, a.length, sample_rng(a.seed, a.task, a.length, 0))
    print(s.prompt_text)
    print(f"expected answer: {s.answer}", file=sys.stderr)


if __name__ == "__main__":
    _main()

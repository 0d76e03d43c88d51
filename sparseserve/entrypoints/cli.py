"""`sparseserve` command line: generate, serve, calibrate, bench. Engine flags come from the config dataclasses,
so every LLM keyword argument is a flag of the same name with dashes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from typing import Any

from sparseserve.config import REMOVED_ARGS, EngineConfig, parse_size
from sparseserve.distributed.group import exit_if_end_stuck

_TYPES = {"int": int, "float": float, "str": str}
# `sparseserve bench NAME` runs module NAME's add_cli_args(parser) + main(args).
BENCHMARKS = {
    "serve": ("sparseserve.bench.serve", "Load-test an OpenAI-compatible server."),
    "accuracy": ("sparseserve.bench.accuracy", "Long-context task accuracy per attention policy."),
    "throughput": ("sparseserve.bench.throughput", "Offline generation throughput vs transformers."),
    "parity": ("sparseserve.bench.parity", "Prompt logits and greedy tokens vs transformers."),
    "kernels": ("sparseserve.bench.kernels", "Attention kernels vs torch SDPA (GPU)."),
}


def size(text: str) -> int:
    """argparse type of the length and memory flags: 4096, 32k (32000), 32K (32768), 2GiB, 1.5G, 4e9."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _help(f: dataclasses.Field) -> str:
    """The field's help with exactly one default: its own words when it has them, else the value."""
    text = f.metadata["help"]
    if "default" not in text:
        text += f" (default: {'none' if f.default is None else f.default})"
    return text.replace("%", "%%")  # argparse %-formats help strings


class _Removed(argparse.Action):
    """A removed option's flag (hidden): the error says why it is gone."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was removed: {REMOVED_ARGS[self.dest]}")


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine")
    for name in REMOVED_ARGS:
        flag = name.replace("_", "-")
        group.add_argument(f"--{flag}", f"--no-{flag}", dest=name, nargs=0, action=_Removed, help=argparse.SUPPRESS)
    for f in EngineConfig.arg_fields():
        if f.name == "model":
            if positional_model:  # `serve MODEL` or `serve --model MODEL`, as in vLLM
                group.add_argument("model", nargs="?", default=None, help=_help(f))
                group.add_argument(
                    "--model",
                    dest="model_option",
                    default=None,
                    help="Same as MODEL (default: MODEL, else the embedded model).",
                )
            else:
                group.add_argument("--model", default=None, help=_help(f))
            continue
        # vLLM's spelling first where it differs from the field's; the field's stays as an alias
        names = [f.metadata["flag"], f.name] if "flag" in f.metadata else [f.name]
        flags = ["--" + n.replace("_", "-") for n in names]
        kind = str(f.type).replace(" | None", "")
        kw: dict[str, Any] = {"default": f.default, "help": _help(f), "dest": f.name}
        if kind == "bool":
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        else:
            typ = size if f.metadata.get("size") else _TYPES[kind]
            group.add_argument(*flags, type=typ, choices=f.metadata.get("choices"), **kw)
    return parser


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(args, f.name) for f in EngineConfig.arg_fields()}
    option = getattr(args, "model_option", None)
    if option is not None:
        if kwargs["model"] not in (None, option):
            raise ValueError(f"two models given: {kwargs['model']!r} and --model {option!r}")
        kwargs["model"] = option
    return kwargs


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="Generate completions offline.")
    add_engine_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        help="A prompt (repeatable; default: a short sentence when no --prompt-file is given).",
    )
    p.add_argument(
        "--prompt-file", help="Read one prompt from a file, e.g. a long document with a question (default: none)."
    )
    p.add_argument("--chat", action="store_true", help="Wrap each prompt in the model's chat template (default: off).")
    p.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default: %(default)s).")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: %(default)s).")
    p.add_argument("--top-k", type=int, default=-1, help="Top-k sampling, -1 disables it (default: %(default)s).")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    from sparseserve import LLM, SamplingParams

    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts.append(f.read())
    if not prompts:
        prompts = ["The best way to learn a new language is"]
    llm = LLM(**engine_kwargs_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        shown = prompt if len(prompt) <= 200 else prompt[:90] + " [...] " + prompt[-90:]
        print(f"Prompt ({len(out.prompt_token_ids)} tokens): {shown!r}\nOutput: {out.outputs[0].text!r}\n")


def _add_module_command(sub, name: str, module: str, help: str, load: bool) -> None:
    """Imports the module (server, benchmark) only when its command runs, so startup stays light."""
    p = sub.add_parser(name, help=help)
    if load:
        mod = importlib.import_module(module)
        mod.add_cli_args(p)
        p.set_defaults(func=mod.main)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sparseserve", description="Long-context LLM serving with sparse attention.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_module_command(
        sub,
        "serve",
        "sparseserve.entrypoints.api_server",
        "Start the OpenAI-compatible server.",
        load=argv[:1] == ["serve"],
    )
    _add_module_command(
        sub,
        "calibrate",
        "sparseserve.calibration.cli",
        "Calibrate streaming heads or sparse prefill thresholds.",
        load=argv[:1] == ["calibrate"],
    )
    bench = sub.add_parser("bench", help="Benchmarks.").add_subparsers(dest="bench", required=True)
    for name, (module, help) in BENCHMARKS.items():
        _add_module_command(bench, name, module, help, load=argv[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser(argv).parse_args(argv)
    status = 0
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as e:  # ImportError: a missing optional extra
        print(f"error: {e}", file=sys.stderr)
        status = 2
    exit_if_end_stuck(status)  # a tensor-parallel group whose end blocked: exit without its destructors
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()

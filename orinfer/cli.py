"""Command line: `orinfer generate | chat | make-tiny | bench | quantize | export | serve` (also `python -m orinfer`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from orinfer.errors import OrinferError

log = logging.getLogger("orinfer")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model directory and every engine setting (orinfer.args.EngineArgs)."""
    from orinfer.args import add_engine_args

    p.add_argument("-m", "--model", required=True, help="local Hugging Face model directory (or the seed's .bin)")
    add_engine_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-think", action="store_true", help="Qwen3: disable thinking (enable_thinking=False)")


def _load(args: argparse.Namespace):
    from orinfer.args import engine_args_from_namespace
    from orinfer.llm import LLM

    return LLM(args.model, engine_args_from_namespace(args))


def _sampling(args: argparse.Namespace):
    from orinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=args.stop)


def _timing_line(out) -> str:
    m = out.metrics
    parts = [f"prompt {m.num_prompt_tokens} tokens", f"generated {m.num_generated_tokens} tokens"]
    if m.vision_encode_ms is not None:
        parts.append(f"vision encode {m.vision_encode_ms:.1f} ms")
    if m.prefill_tok_s:
        parts.append(f"prefill {m.prefill_tok_s:.1f} tok/s")
    if m.decode_tok_s:
        parts.append(f"decode {m.decode_tok_s:.1f} tok/s")
    if m.ttft_s is not None:
        parts.append(f"TTFT {m.ttft_s * 1000:.1f} ms")
    parts.append(f"finish: {out.finish_reason}")
    return "[" + ", ".join(parts) + "]"


def _stream_to_stdout(llm, prompt, params) -> None:
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(_timing_line(llm.last_output), file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # validate before the (slow) model load
    llm = _load(args)
    prompt = args.prompt
    thinking = False if args.no_think else None
    if args.image:
        # Images need their placeholders, which the chat template writes: an image prompt is always a chat turn.
        parts = [{"type": "image", "image": path} for path in args.image] + [{"type": "text", "text": prompt}]
        prompt = llm.chat_prompt([{"role": "user", "content": parts}], enable_thinking=thinking)
    elif args.chat:
        prompt = llm.render_chat([{"role": "user", "content": prompt}], enable_thinking=thinking)
    _stream_to_stdout(llm, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _load(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model. /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.render_chat(messages, enable_thinking=False if args.no_think else None)
        reply = []
        try:
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop this answer, keep the session
            pass
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        if hasattr(llm, "last_output"):
            print(_timing_line(llm.last_output), file=sys.stderr)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from orinfer.tiny import make_tiny

    path = make_tiny(args.out_dir, arch=args.arch, train_steps=args.train_steps, seed=args.seed)
    print(f"wrote a tiny {args.arch} model to {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from orinfer.bench.run import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orinfer", description="Qwen inference engine")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING (default) | ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt and print timings")
    _add_model_args(gen)
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--image", action="append", default=None, metavar="PATH",
                     help="an image for a vision-language model (repeatable; implies --chat)")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    _add_model_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=512)

    tiny = sub.add_parser("make-tiny", help="write a small locally trained Qwen model (no hub needed)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen2", "qwen3-vl", "qwen3-moe"],
                      help="qwen3-vl: the qwen3 language model behind a small random vision tower; qwen3-moe: "
                           "8 experts, 2 per token, in the layers after the first")
    tiny.add_argument("--train-steps", type=int, default=160, help="AdamW steps on the bundled text (0: random)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)

    try:
        from orinfer.bench.run import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub, cmd_bench)
    from orinfer.quant.cli import add_export_parser, add_quantize_parser

    add_quantize_parser(sub)   # orinfer quantize IN OUT --method awq|rtn [--group-size] [--calib FILE]
    add_export_parser(sub)     # orinfer export IN_DIR OUT.bin
    from orinfer.server.cli import add_serve_parser  # FastAPI/uvicorn load only when `serve` runs

    add_serve_parser(sub)      # orinfer serve -m DIR [--host] [--port] [--api-key] [--served-model-name]
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except OrinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

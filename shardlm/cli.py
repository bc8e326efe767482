"""The ``shardlm`` command: ``generate``, ``serve``, ``train``, ``plan`` and ``bench``.

Bad input prints one line and exits 2; a failed rank prints what failed and exits 1.
Logs go to stderr, results to stdout (one JSON object per line with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shardlm.args import (
    add_layout_args,
    add_log_level,
    front_options,
    layout_options,
    loading_line,
    log,
    setup_logging,
    with_config_file,
)
from shardlm.engine.config import AXES as ENGINE_AXES


def add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from prompts, split over ranks",
        description="Generate completions for one or more prompts with the model split over "
        "tp ranks (started on this host, or by torchrun).",
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text; several prompts run as one batch")
    add_layout_args(p, ENGINE_AXES)
    # unset: the model's generation_config.json (--generation-config), else the defaults named here
    p.add_argument("--max-new-tokens", type=int, default=None, help="most tokens to generate per prompt (128)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0: all, default)")
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="encode prompts as-is, as the model's HF tokenizer does, instead of applying the chat template",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then a timing line")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from shardlm.engine.config import EngineConfig
    from shardlm.engine.llm import LLM, check_layout, sampling_defaults, settle
    from shardlm.engine.sampling import SamplingParams
    from shardlm.launch import torchrun_env
    from shardlm.models.loader import open_checkpoint
    from shardlm.models.tokenizer import IncrementalDecoder

    speaker = (torchrun_env() or {"rank": 0})["rank"] == 0
    prompts = args.prompts or ([sys.stdin.read()] if not sys.stdin.isatty() else [])
    if not prompts:
        raise_usage('give at least one prompt, e.g. shardlm generate "Hello" (or pipe one on stdin)')
    ckpt = open_checkpoint(args.model)
    given = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k}  # fmt: skip
    fields = {"max_tokens": 128, "temperature": 0.0, **sampling_defaults(args.generation_config, ckpt)}
    fields.update({k: v for k, v in given.items() if v is not None})
    if fields["max_tokens"] < 1:
        raise_usage(f"--max-new-tokens {fields['max_tokens']} must be at least 1, e.g. --max-new-tokens 128")
    params = SamplingParams(**fields, seed=args.seed if fields["temperature"] > 0 else None)
    tokenizer = ckpt.tokenizer()
    tokenizer.chat_template = args.chat_template or tokenizer.chat_template
    chat = not args.no_chat and bool(tokenizer.chat_template)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    options = layout_options(args)
    config = settle(EngineConfig.of(model=str(ckpt.path), **options), ckpt)
    check_layout(config, ckpt)
    if speaker:
        log(loading_line(args.model, ckpt, config))
    with LLM(ckpt, tokenizer=tokenizer, **options, **front_options(args)) as llm:
        for p, c in zip(prompts, conversations):  # reject a prompt that does not fit before generating
            if chat:
                llm.encode_chat(c)
            else:
                llm.encode(p)
        if speaker:
            log(
                f"loaded in {llm.load_s:.1f} s; parameters per rank (MiB): {llm.param_mib()}; KV cache: {llm.kv_blocks} blocks "
                f"of {llm.config.block_size} tokens{' on each cp rank' if llm.dims.cp > 1 else ''} = "
                f"{llm.kv_tokens} tokens per replica"
            )
        stream = speaker and not args.json and len(prompts) == 1
        decoder = IncrementalDecoder(tokenizer)
        on_token = (lambda i, tok: print(decoder.push(tok), end="", flush=True)) if stream else None
        start = time.perf_counter()
        if chat:  # the template's ids, not its text re-encoded (which could add a second BOS)
            outputs = llm.chat(conversations, params, on_token=on_token)
        else:
            outputs = llm.generate(prompts, params, on_token=on_token)
        wall = time.perf_counter() - start
        if not speaker:
            return 0
        if stream:
            print(decoder.flush(), flush=True)
        for prompt, out in zip(prompts, outputs):
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": out.text,
                            "token_ids": out.token_ids,
                            "prompt_tokens": len(out.prompt_token_ids),
                            "completion_tokens": len(out.token_ids),
                            "finish_reason": out.finish_reason,
                        }
                    )
                )
            elif not stream:
                print(f"--- {prompt}\n{out.text}\n")
        s = llm.last_stats
        timing = {
            "load_s": round(llm.load_s, 3),
            "ttft_s": round(s.first_token_s or 0.0, 4),
            "decode_tok_s": round(s.decode_tok_s, 2) if s.decode_tok_s else None,
            "generated_tokens": s.generated_tokens,
            "generated_tokens_per_replica": [r.generated_tokens for r in llm.last_replica_stats],
            "wall_s": round(wall, 3),
            "tp": args.tp,
            "pp": args.pp,
            "dp": args.dp,
            "ep": args.ep,
            "dtype": llm.config.dtype,
            "param_bytes_per_rank": llm.param_bytes,
            "offloaded_bytes_per_rank": llm.offloaded_bytes,
        }
        if s.expert_load is not None:  # MoE: tokens per expert / ep rank and max/mean imbalance per layer
            timing["expert_load"] = s.expert_load
        if args.json:
            print(json.dumps({"timing": timing}))
        else:
            log(f"ttft {timing['ttft_s']} s, decode {timing['decode_tok_s']} tok/s")
    return 0


def raise_usage(msg: str):
    from shardlm.errors import UsageError

    raise UsageError(msg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlm", description="Run LLMs split over many devices, and plan the split."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    from shardlm.plan.cli import add_parser as add_plan

    add_plan(sub)
    from shardlm.bench.cli import add_parser as add_bench

    add_bench(sub)
    from shardlm.server.cli import add_parser as add_serve

    add_serve(sub)
    from shardlm.train.cli import add_parser as add_train

    add_train(sub)
    for command in ("generate", "serve", "train"):
        add_log_level(sub.choices[command])
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    from shardlm.launch import leave

    leave(code)  # a torchrun rank whose group shardlm started ends here, skipping interpreter teardown
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from shardlm.errors import PeerLost, RankFailure, UsageError

    try:
        if getattr(args, "config", None):
            commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            args = with_config_file(parser, commands.choices[args.command], argv)
        setup_logging(getattr(args, "log_level", "info"))
        return args.func(args)
    except UsageError as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:  # under torchrun a rank that lost a peer says which rank it is
        from shardlm.launch import relayed_failure

        who = f"rank {os.environ['RANK']}: " if isinstance(e, PeerLost) and "RANK" in os.environ else ""
        print(f"shardlm: error: {who}{relayed_failure(e) or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardlm: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:  # under torchrun a collective raises where a peer is lost
        from shardlm.launch import lost_ranks, peer_failure
        from shardlm.parallel.shm_segment import give_up_everywhere

        if (line := peer_failure(e)) is None:
            raise
        give_up_everywhere(lost_ranks(e))  # this host's peers waiting on this rank name the lost host too
        print(f"shardlm: error: rank {os.environ.get('RANK', '?')}: {line}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""``shardlm serve``: the OpenAI-compatible server over ranks started on this host.

The port is bound before the model loads, so a busy port fails at once. Start-up logs
the layout and the KV cache (blocks and tokens) on stderr, then ``serving on URL``.
A rank that dies turns ``/health`` to 503 and fails the requests in flight; after
``--grace`` seconds the server stops every rank and exits 1 with the reason. SIGINT or
SIGTERM stop it cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket

from shardlm.args import add_layout_args, front_options, layout_options, loading_line, log
from shardlm.engine.config import AXES as ENGINE_AXES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API (chat/completions, completions) over ranks",
        description="An OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics; the model split over tp x pp x dp ranks.",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the name clients put in 'model' (default: --model as given)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; the URL is logged)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 requests (vLLM's flag; default: no key)",
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as in `vllm serve MODEL` (or --model)"
    )
    add_layout_args(p, ENGINE_AXES)
    p.add_argument(
        "--eplb-interval",
        type=int,
        default=0,
        metavar="R",
        help="MoE: re-place experts from the observed load every R rounds (default 0: never)",
    )
    p.add_argument(
        "--eplb-redundant",
        type=int,
        default=0,
        metavar="K",
        help="MoE: spare expert slots per layer for replicas of the hottest experts (default 0)",
    )
    p.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="P",
        help="prefill/decode disaggregation: the first P of the --dp replicas compute prompts, the "
        "others decode, receiving each prompt's KV cache (default 0: every replica does both)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded together per replica")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="per-step token budget: longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests in flight (queued or running) beyond which new ones get 429",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        help="seconds to keep answering 503 after a rank dies, before exiting (default 3)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level (vLLM's flag; info adds its access log); shardlm's own: --log-level",
    )
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from shardlm.errors import RankFailure, UsageError

    if args.model_tag is not None:  # vLLM's positional form
        if args.model not in ("smollm2", args.model_tag):
            raise UsageError(f"serve {args.model_tag} --model {args.model}: two models; give one of them")
        args.model = args.model_tag
    if args.max_queue < 1:
        raise UsageError(f"--max-queue {args.max_queue} must be at least 1, e.g. --max-queue 1024")
    if args.grace < 0:
        raise UsageError(f"--grace {args.grace} must be >= 0 seconds, e.g. --grace 3")
    from shardlm.launch import torchrun_env

    env = torchrun_env()
    if env is not None and env["rank"] != 0:  # under torchrun: global rank 0's process serves HTTP and drives
        from shardlm.engine.worker import serve_under_torchrun

        return serve_under_torchrun(_engine_config(args))
    # uvicorn re-raises SIGTERM after its graceful shutdown, and one may come while the model loads:
    # make it a KeyboardInterrupt, so every rank is stopped on the way out instead of a silent death
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sock = _bind(args.host, args.port)
    try:
        engine = _start_engine(args)
    except BaseException:
        sock.close()
        raise
    try:
        from shardlm.server.app import build_app

        app = build_app(engine, model_name=args.served_model_name or args.model, api_key=args.api_key)
        host, port = sock.getsockname()[:2]
        log(
            f"serving {args.served_model_name or args.model} on http://{_url_host(host)}:{port}/v1 "
            f"(max_model_len {engine.max_model_len}, max_queue {args.max_queue})"
        )
        died = asyncio.run(_serve(app, engine, sock, args))
    except KeyboardInterrupt:  # SIGINT/SIGTERM, re-raised by uvicorn after its graceful shutdown
        died = False
    finally:
        engine.shutdown()
        sock.close()
    if died:
        raise RankFailure(f"{engine.error}; the server stopped (all ranks ended)")
    log("shardlm serve: stopped; all ranks ended")
    return 0


def _bind(host: str, port: int) -> socket.socket:
    from shardlm.errors import UsageError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port (or --port 0 for a free one) or --host"
        ) from None
    sock.listen(2048)
    return sock


def _options(args) -> dict:
    """The engine options (``EngineConfig.of``) the flags set."""
    return dict(
        layout_options(args),
        eplb_interval=args.eplb_interval,
        eplb_redundant=args.eplb_redundant,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_replicas=args.prefill_replicas,
    )


def _engine_config(args):
    """The ranks' EngineConfig, settled for the model (what AsyncLLM hands its ranks)."""
    from shardlm.engine.config import EngineConfig
    from shardlm.engine.llm import settle
    from shardlm.models.loader import open_checkpoint

    ckpt = open_checkpoint(args.model)
    return settle(EngineConfig.of(model=str(ckpt.path), **_options(args)), ckpt)


def _start_engine(args):
    from shardlm.engine.async_llm import AsyncLLM
    from shardlm.models.loader import open_checkpoint

    ckpt = open_checkpoint(args.model)
    options = _options(args)
    config = _engine_config(args)
    log(loading_line(args.model, ckpt, config))
    engine = AsyncLLM(ckpt, max_queue=args.max_queue, **options, **front_options(args))
    if args.prefill_replicas:
        span = lambda a, b: str(a) if a == b else f"{a}-{b}"
        log(
            f"disaggregated: replica {span(0, args.prefill_replicas - 1)} prefill, "
            f"{span(args.prefill_replicas, args.dp - 1)} decode (KV cache handed over after each first token)"
        )
    bs, cp = engine.config.block_size, engine.dims.cp
    per_cp = f" on each of the {cp} cp ranks (a sequence's blocks striped over them)" if cp > 1 else ""
    sizing = (
        f"--gpu-memory-utilization {args.gpu_memory_utilization}"
        if args.gpu_memory_utilization is not None
        else f"--kv-cache-memory {engine.config.kv_cache_memory / 2**30:.2f} GiB per rank"
    )
    log(f"loaded in {engine.load_s:.1f} s; parameters per rank (MiB): {engine.param_mib()}")
    log(
        f"KV cache: {engine.kv_blocks} blocks of {bs} tokens{per_cp} = {engine.kv_tokens} tokens per replica "
        f"({sizing}, {engine.config.kv_torch_dtype} elements)"
    )
    return engine


async def _serve(app, engine, sock: socket.socket, args) -> bool:
    """Run until a signal (returns False) or a dead rank (returns True, after the grace period)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=5,
            lifespan="off",
            access_log=args.uvicorn_log_level in ("debug", "info"),
        )
    )
    died = False

    async def watch() -> None:
        nonlocal died
        while not server.should_exit:
            if not engine.healthy:
                died = True
                log(f"shardlm serve: {engine.error}; answering 503 for {args.grace:g} s, then exiting")
                await asyncio.sleep(args.grace)
                server.should_exit = True
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
    return died


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

"""Command-line pieces shared by the sub-commands (generate, serve, train, plan, bench): argument
types, the model-and-layout flags, and the stderr log line.

It sits low in the import layers (above ``parallel``, whose ParallelDims names the axis flags) so that every
sub-command's ``cli`` module can use it without importing ``shardlm.cli``, the top of the stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from shardlm.parallel.dims import axes, axis_help, vllm_name

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'2GiB', '512M', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or 1000000000")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def layer_counts(text: str) -> tuple[int, ...]:
    """'10,10,10' -> (10, 10, 10)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of layer counts; write e.g. 10,10,10") from None


def json_object(text: str) -> dict:
    """'{"method": "ngram"}' -> a dict."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f'{text!r} is not JSON ({e.msg}); write e.g. \'{{"method": "ngram", "num_speculative_tokens": 4}}\''
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'{text!r} is not a JSON object; write e.g. \'{{"method": "ngram"}}\'')
    return value


def add_config_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help='take flags from a TOML file, each flag a key (tp = 2, lr-schedule = "cosine"); flags on the '
        "command line override it",
    )


def with_config_file(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse ``argv`` again with the keys of ``--config``'s TOML file as ``command``'s defaults, so
    that flags given on the command line win. A key is a flag's name without the dashes (``lr-schedule``
    or ``lr_schedule``); an unknown key, or a value of the wrong kind, is refused naming it."""
    import difflib

    from shardlm.errors import UsageError

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[import-not-found]

    path = Path(parser.parse_args(argv).config)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"--config {str(path)!r}: {e.strerror}; give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {str(path)!r} is not TOML: {e}") from None
    actions: dict[str, argparse.Action] = {}  # by dest and by every long flag: tp, tensor_parallel_size, ...
    for a in command._actions:
        if a.option_strings and a.dest not in ("help", "config"):
            for name in [a.dest] + [o.lstrip("-").replace("-", "_") for o in a.option_strings]:
                actions.setdefault(name, a)
    defaults = {}
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None:
            near = difflib.get_close_matches(key.replace("-", "_"), list(actions), n=1)
            hint = f"did you mean {near[0].replace('_', '-')!r}?" if near else "each key is a flag of this command"
            raise UsageError(f"--config {str(path)!r}: unknown key {key!r}; {hint}")
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch such as --json
            if not isinstance(value, bool):
                raise UsageError(f"--config {str(path)!r}: {key} = {value!r} must be true or false, as {flag}")
        else:
            if isinstance(value, (dict, list, bool)):
                raise UsageError(f"--config {str(path)!r}: {key} = {value!r} must be one value, as {flag} takes")
            try:  # as if it came on the command line: the flag's type and choices apply
                value = action.type(str(value)) if callable(action.type) else str(value)
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"--config {str(path)!r}: {key} = {table[key]!r}: {e}") from None
            except ValueError:
                kind = getattr(action.type, "__name__", "value")
                raise UsageError(
                    f"--config {str(path)!r}: {key} = {table[key]!r}: invalid {kind} value for {flag}"
                ) from None
            if action.choices is not None and value not in action.choices:
                choices = ", ".join(map(str, action.choices))
                raise UsageError(f"--config {str(path)!r}: {key} = {table[key]!r} is not one of {choices}")
        defaults[action.dest] = value
    command.set_defaults(**defaults)
    return parser.parse_args(argv)


LOG = logging.getLogger("shardlm")
LOG_LEVELS = ("debug", "info", "warning", "error")


def log(msg: str) -> None:
    """A progress line of a command (stderr, through ``logging``: ``--log-level warning`` hides it)."""
    LOG.info(msg)


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        metavar="LEVEL",
        help="debug, info, warning or error: what goes to stderr; info (default) shows progress and, under serve, one line per request; "
        "warning and error only problems; debug everything",
    )


def setup_logging(level: str) -> None:
    """Plain lines on stderr at ``level`` for shardlm's loggers (libraries keep their own)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOG.handlers[:] = [handler]
    LOG.setLevel(level.upper())
    LOG.propagate = False


def add_axis_args(p: argparse.ArgumentParser, offered: tuple[str, ...], default: int | None = 1) -> None:
    """A ``--AXIS`` flag for each parallel axis the command ``offered`` (its help from ParallelDims)."""
    for axis in offered:
        names = [f"--{axis}"]
        if (vllm := vllm_name(axis)) is not None:  # vLLM's spellings: --tensor-parallel-size, -tp
            names += [f"--{vllm.replace('_', '-')}", f"-{axis}"]
        p.add_argument(*names, dest=axis, type=int, default=default, help=axis_help(axis))


def axis_options(args: argparse.Namespace) -> dict[str, int]:
    """{axis: size} of the axis flags this command's parser has."""
    return {a: getattr(args, a) for a in axes() if hasattr(args, a)}


def add_layout_args(p: argparse.ArgumentParser, offered: tuple[str, ...]) -> None:
    """The model and its layout over ranks (the ``offered`` axes): shared by generate and serve."""
    p.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded SmolLM2-135M-Instruct), a HF directory, or a .gguf file"
    )
    add_axis_args(p, offered)
    p.add_argument(
        "--pp-layers",
        type=layer_counts,
        default=None,
        metavar="N,N,...",
        help="layers per pipeline stage, e.g. 10,10,10 (default: balanced by per-token work)",
    )
    p.add_argument(
        "--micro-batches", type=int, default=None, help="batches in flight through the pipeline (default: pp)"
    )
    p.add_argument(
        "--cp-attention",
        choices=("pass-q", "ulysses", "ring"),
        default="pass-q",
        help="with --cp: attend a prompt that arrives whole by pass-q (queries gathered to the striped "
        "KV cache; default), ulysses (heads split over the cp ranks for that prompt) or ring (its keys "
        "and values passed around the cp ranks)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None, help="KV cache per rank (default 2GiB)")
    p.add_argument("--seed", type=int, default=0, help="base seed for requests that give none (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait before the run fails")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto (default, as vLLM): the checkpoint's dtype (float32 for GGUF), bfloat16 on a GPU for a float32 one",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's flag: MoE experts split over all dp x tp ranks (ep = dp*tp, etp = 1); dense models: no effect",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "gguf"],
        help="weight-only, linear layers (embedding and LM head stay): int8 (a scale per output row), int4 (a "
        "scale and zero per 32 inputs; a GGUF's Q4_0/Q4_1/Q4_K blocks as they are), gguf (a GGUF file's Q4_0/Q4_1/Q4_K "
        "layers kept as int4, other types dequantized); default: float (GGUF blocks dequantized)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache elements: auto (the model's dtype), int8 (with a scale per token and head), int4 "
        "(two a byte, a scale per 32 elements) or fp8: 2-6x the tokens per GiB",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when this host has a GPU per rank, else cpu",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps through torch.compile: faster decoding after a one-time compile "
        "(tens of seconds, cached on disk); dense models",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (by default a GPU replays one per decode shape class; tp=1, dense models)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="on a GPU: the KV cache gets what is left of this fraction of its memory after the weights "
        "(vLLM's flag; instead of --kv-cache-memory)",
    )
    p.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0,
        metavar="GIB",
        help="on a GPU: keep this many GiB of each rank's layer weights in CPU memory, copied in a layer "
        "ahead of use (vLLM's flag; for a model larger than the GPU; the run is eager)",
    )
    p.add_argument(
        "--chat-template",
        type=chat_template,
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) instead of the model's (vLLM's flag)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="default sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
        "from generation_config.json: auto (the model's, default), vllm (none), or a directory holding one",
    )
    p.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        '(drafts looked up in each sequence\'s history), \'{"model": PATH, "num_speculative_tokens": 4}\' '
        '(a draft model with the same vocabulary), or \'{"method": "layer_skip", "num_layers": 8}\' '
        "(the model's own first layers draft); greedy output unchanged",
    )


def chat_template(value: str) -> str:
    """--chat-template (vLLM's): a file holding a Jinja chat template, or the template itself."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a file nor a Jinja template; give a path, or the template in one line"
    )


def front_options(args) -> dict:
    """The options of ``LLM`` / ``AsyncLLM`` themselves (not of the ranks) that add_layout_args' flags set."""
    return {"chat_template": args.chat_template, "generation_config": args.generation_config}


def layout_options(args) -> dict:
    """The EngineConfig fields (flat: ``EngineConfig.of``) that add_layout_args' flags set."""
    return dict(
        **axis_options(args),
        pp_layers=args.pp_layers,
        micro_batches=args.micro_batches,
        dtype=args.dtype,
        enable_expert_parallel=args.enable_expert_parallel,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_offload_gb=args.cpu_offload_gb,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        cp_attention=args.cp_attention,
        device=args.device,
        compile=args.compile,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        max_model_len=args.max_model_len,
        seed=args.seed,
        timeout_s=args.timeout,
        threads=args.threads,
        **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory is not None else {}),
    )


def loading_line(model: str, ckpt, config) -> str:
    """The first log line of generate and serve: what loads, on how many ranks, in which layout."""
    dims = config.parallel
    world = config.dims().world_size
    axes = ", ".join(f"{a}={getattr(dims, a)}" for a in ("dp", "pp", "tp", "ep") if getattr(dims, a) > 1)
    return (
        f"loading {model} ({ckpt.kind}, {ckpt.config.family}, {ckpt.config.num_layers} layers) on {world} "
        f"rank{'s' if world > 1 else ''} ({axes or 'one process'}, {config.dtype})"
    )

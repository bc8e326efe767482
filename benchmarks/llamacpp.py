"""SmolLM2's own Q4_1 GGUF, batch 1: shardlm (``quantization="gguf"``: the file's Q4_1 blocks and its
Q8_0 embedding / LM head as they are, multiplied in integers by ``parallel/int4_cpu.cpp``) against
llama.cpp (``llama-cpp-python``) on the same file, same machine, same thread count, loaded
together and timed in turns (best of --repeats). shardlm runs with --dtype float32 by default:
its kernels take float32 activations as they are, and on this CPU float32's attention and norms
are faster than bfloat16's (no casts around every op).

* decode tok/s at batch 1: wall time of (1 + N) greedy tokens minus that of 1 token (prefill and
  the first token do not count), as ``benchmarks/decode.py``;
* prefill of a 512-token prompt (fresh random tokens each turn, so no prefix cache helps): tok/s;
* RSS: what each engine added to this process (at tp=1 shardlm's worker runs in it) once loaded
  and warmed up: llama.cpp memory-maps the file, so its figure counts the pages it touched.

llama-cpp-python ships as a source package: it is built once (CPU only, ``CMAKE_BUILD_PARALLEL_LEVEL=2``)
into a wheel under --cache (default ~/.cache/shardlm/llamacpp) and installed from there into
``<cache>/site``; if it cannot be built the benchmark says so and prints shardlm's figures alone.

    python benchmarks/llamacpp.py [--threads 1] [--tokens 64] [--prompt 512] [--repeats 3] [--compile] [--no-build]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from decode import decode_rate

from shardlm import LLM, SamplingParams
from shardlm.models.registry import smollm2_gguf_path

QUESTION = "Explain tensor parallelism in one paragraph."
VERSION = "0.3.36"
CPU_ONLY = "-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"


def import_llama_cpp(cache: Path, build: bool, build_timeout: float):
    """The ``llama_cpp`` module: installed, or from the cache (built there first if need be), or None."""
    site = cache / "site"
    sys.path.insert(0, str(site))
    try:
        import llama_cpp

        return llama_cpp
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(cache / "wheels" / "llama_cpp_python-*.whl")))
    if not wheels:
        if not build:
            print(f"skipped llama.cpp: no wheel in {cache / 'wheels'} and --no-build given")
            return None
        print(f"building llama-cpp-python {VERSION} (CPU only, 2 jobs) into {cache / 'wheels'}; once", flush=True)
        env = {**os.environ, "CMAKE_ARGS": CPU_ONLY, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        wheel = ["wheel", "--no-deps", "-w", str(cache / "wheels"), f"llama-cpp-python=={VERSION}"]
        cmd = [sys.executable, "-m", "pip", *wheel]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=build_timeout)
        except subprocess.TimeoutExpired:
            print(f"skipped llama.cpp: building llama-cpp-python took over {build_timeout:.0f} s")
            return None
        wheels = sorted(glob.glob(str(cache / "wheels" / "llama_cpp_python-*.whl")))
        if out.returncode or not wheels:
            tail = "\n  ".join((out.stdout + out.stderr).strip().splitlines()[-5:])
            print(f"skipped llama.cpp: llama-cpp-python could not be built:\n  {tail}")
            return None
    # its runtime dependencies but numpy/jinja2/typing-extensions (already here): diskcache
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site)]
    subprocess.run([*pip, "--no-deps", wheels[-1], "diskcache"], check=True)
    sys.path_importer_cache.pop(str(site), None)  # looked up above, before it existed
    import llama_cpp

    return llama_cpp


class LlamaCpp:
    """llama.cpp on the same file: greedy decode and prefill through its low-level eval."""

    def __init__(self, module, path: str, threads: int, ctx: int):
        self.llm = module.Llama(
            model_path=path, n_ctx=ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.vocab = self.llm.n_vocab()

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt`` (fresh context each call)."""
        self.llm.reset()
        out: list[int] = []
        feed = prompt
        while len(out) < n:
            self.llm.eval(feed)  # the last position's logits stay in the context (logits_all=False)
            out.append(int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,)).argmax()))
            feed = out[-1:]
        return out


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="threads of each engine (the same for both)")
    ap.add_argument("--dtype", default="float32", help="shardlm's activations and KV cache (bfloat16 too)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed per run")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "shardlm" / "llamacpp"))
    ap.add_argument("--compile", action="store_true", help="also shardlm with compile=True (compiles ~100 s once)")
    ap.add_argument("--no-build", action="store_true", help="do not build llama-cpp-python if it is not there")
    ap.add_argument("--build-timeout", type=float, default=1800.0, help="seconds the one-time build may take")
    args = ap.parse_args()
    path = str(smollm2_gguf_path())
    module = import_llama_cpp(Path(args.cache), not args.no_build, args.build_timeout)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ctx = args.prompt + args.tokens + 64
    # at tp=1 LLM runs its worker in this process: RSS is measured as what each engine adds to it
    rss: dict[str, float] = {}
    engines: dict = {}
    llms = []
    for name, compile_ in [("shardlm int4", False)] + ([("shardlm compiled", True)] if args.compile else []):
        before = rss_mib(os.getpid())
        llm = LLM(
            "smollm2", quantization="gguf", dtype=args.dtype, threads=args.threads, max_model_len=ctx, compile=compile_
        )
        llms.append(llm)
        rss[name] = rss_mib(os.getpid()) - before

        def shardlm_run(prompt: list[int], n: int, llm=llm) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            return llm.generate([prompt], params)[0].token_ids

        engines[name] = shardlm_run
    chat = llms[0].encode_chat([{"role": "user", "content": QUESTION}])
    if module:
        before = rss_mib(os.getpid())
        theirs = LlamaCpp(module, path, args.threads, ctx)
        engines["llama.cpp"] = theirs.generate
    decode = dict.fromkeys(engines, 0.0)
    prefill = dict.fromkeys(engines, 0.0)
    for run in engines.values():  # warm-up (the compiled engine compiles here)
        run(chat, 2)
        run(chat[:8], 2)
    if module:
        rss["llama.cpp"] = rss_mib(os.getpid()) - before  # its weights are mmapped: pages it touched
    for _ in range(args.repeats):
        for name, run in engines.items():
            decode[name] = max(decode[name], decode_rate(lambda n, run=run: run(chat, n), args.tokens))
            prompt = torch.randint(100, 40000, (args.prompt,), generator=g).tolist()
            start = time.perf_counter()
            run(prompt, 1)
            prefill[name] = max(prefill[name], args.prompt / (time.perf_counter() - start))
    print(
        f"SmolLM2-135M Q4_1 GGUF, batch 1, {args.threads} thread(s) each, best of {args.repeats} in turns; "
        f"shardlm --quantization gguf --dtype {args.dtype}; "
        f"torch {torch.__version__}{', llama-cpp-python ' + module.__version__ if module else ''}\n"
    )
    print(f"{'engine':<17} {'decode tok/s':>12} {f'prefill {args.prompt} tok/s':>18} {'RSS MiB':>8}")
    for name in engines:
        print(f"{name:<17} {decode[name]:>12.1f} {prefill[name]:>18.1f} {rss.get(name, float('nan')):>8.0f}")
    if module:
        for name in engines:
            if name != "llama.cpp":
                d, p = decode[name] / decode["llama.cpp"], prefill[name] / prefill["llama.cpp"]
                print(f"{name} / llama.cpp: decode {d:.2f}x, prefill {p:.2f}x")
        a, b = engines["shardlm int4"](chat, 32), theirs.generate(chat, 32)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"greedy tokens: the first {same} of 32 the same as llama.cpp's (its activations go through Q8_1)")
    for llm in llms:
        llm.close()


if __name__ == "__main__":
    main()

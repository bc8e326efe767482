"""Two hosts on one machine (tests/harness/hosts.py: network, UTS and mount namespaces joined by a
veth pair) running shardlm under torchrun, one node each: the same tokens and losses as one host,
shared memory only inside a host, and a lost host ending the other's run with one line.

The model is a tiny random Llama (HF's greedy tokens recorded with it): a test runs 4-6 ranks on
two cores, and with SmolLM2 each rank's load took most of the time, for nothing the hosts test."""

from __future__ import annotations

import itertools
import json
import os
import re
import selectors
import sys
import time

import pytest

from harness.hosts import ADDRESSES, TwoHosts, both, report
from harness.reference import PROMPTS, Reference, build_tiny, word_tokenizer
from shardlm import LLM, SamplingParams

why_not = TwoHosts.available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=why_not or "")
TEXTS = [" ".join(f"w{i}" for i in p) for p in PROMPTS]  # the word tokenizer's text of each prompt
_ports = itertools.count(29600)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    rig = TwoHosts(tmp_path_factory.mktemp("hosts"))
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Reference:
    """6 layers (pp 2), 6 query and KV heads (tp 2 and 3 split them), positions for long runs, and a
    word tokenizer (token i is the word ``w{i}``)."""
    ref = build_tiny("llama", tmp_path_factory.mktemp("tiny"), num_key_value_heads=6, max_position_embeddings=8192)
    word_tokenizer(ref.path, 251)
    return ref


def one_process_losses(model: str, text: str, steps: int) -> list[float]:
    """The CLI's batches and defaults (lr 1e-4, clipping at 1, float32 on CPU) in this process."""
    from shardlm.models.loader import open_checkpoint
    from shardlm.train.data import Batches
    from shardlm.train.trainer import TrainConfig, Trainer

    batches = Batches(open_checkpoint(model).tokenizer().encode(text), seq_len=16, batch_size=2, seed=0)
    one = Trainer(TrainConfig(model=model, threads=1))
    return [one.step(batches(i))["loss"] for i in range(steps)]


def dp2_training(tiny: Reference, data) -> list[str]:
    """`train` at dp 2 (a rank per host) on the tiny model: the fault tests' run."""
    args = ["train", "--model", str(tiny.path), "--data", str(data), "--dp", "2", "--batch-size", "2"]
    return [*args, "--seq-len", "16", "--threads", "1"]


def words(n: int, seed: int) -> str:
    """A training text of ``n`` of the tiny model's words."""
    return " ".join(f"w{(i * 37 + seed) % 250 + 1}" for i in range(n))


def on_both(hosts: TwoHosts, nproc: int, args: list[str], timeout: float = 240) -> dict:
    port = next(_ports)
    return both({h: hosts.torchrun(h, nproc, args, port=port) for h in ("A", "B")}, timeout)


def test_generate_tp2_pp2_across_hosts_gives_hfs_tokens(hosts, tiny):
    """tp inside a host, pp across (the mesh's order: tp is the innermost axis): HF's greedy tokens;
    each host's tp group uses shared memory (the pp stages talk point to point)."""
    args = ["generate", "--model", str(tiny.path), "--tp", "2", "--pp", "2", "--no-chat", "--json", "--threads", "1"]
    out = on_both(hosts, 2, [*args, "--max-new-tokens", "32", "--log-level", "debug", *TEXTS])
    assert all(code == 0 for code, _, _ in out.values()), report(out)
    printed = [json.loads(line) for _, stdout, _ in out.values() for line in stdout.splitlines()]
    assert [p["token_ids"] for p in printed[:-1]] == tiny.tokens and "timing" in printed[-1]  # global rank 0 prints
    logs = "".join(err for _, _, err in out.values())
    groups = re.findall(r"collectives of ranks \[(\d+), (\d+)\]: (shared memory|gloo)", logs)
    assert set(groups) == {("0", "1", "shared memory"), ("2", "3", "shared memory")}  # tp, one host each


@pytest.mark.slow  # ~17 s; make test keeps tp2 pp2 across the hosts
def test_generate_dp2_with_a_replica_per_host_gives_hfs_tokens(hosts, tiny):
    """dp across the hosts (the outermost axis), tp=2 inside each: a replica per host, each
    generating for two of the four prompts, and HF's greedy tokens for every prompt."""
    args = ["generate", "--model", str(tiny.path), "--dp", "2", "--tp", "2", "--no-chat", "--json", "--threads", "1"]
    out = on_both(hosts, 2, [*args, "--max-new-tokens", "32", "--log-level", "debug", *TEXTS])
    assert all(code == 0 for code, _, _ in out.values()), report(out)
    printed = [json.loads(line) for _, stdout, _ in out.values() for line in stdout.splitlines()]
    assert [p["token_ids"] for p in printed[:-1]] == tiny.tokens
    assert printed[-1]["timing"]["generated_tokens_per_replica"] == [2 * 32, 2 * 32]  # both replicas worked
    logs = "".join(err for _, _, err in out.values())
    groups = re.findall(r"collectives of ranks \[(\d+), (\d+)\]: (shared memory|gloo)", logs)
    assert set(groups) == {("0", "1", "shared memory"), ("2", "3", "shared memory")}  # a replica's tp, one host


def test_train_dp2_tp3_zero3_across_hosts_takes_one_hosts_steps(hosts, tiny, tmp_path):
    """A replica per host (dp across, tp=3 inside): one process's losses; ZeRO-3's dp groups (across
    the hosts) stay on gloo while the tp groups use shared memory, in one run."""
    data = tmp_path / "data.txt"
    data.write_text(words(400, seed=1))
    args = ["train", "--model", str(tiny.path), "--data", str(data), "--dp", "2", "--tp", "3", "--zero", "3"]
    args += ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--threads", "1", "--json"]
    want = one_process_losses(str(tiny.path), data.read_text(), 2)
    out = on_both(hosts, 3, [*args, "--log-level", "debug"])
    assert all(code == 0 for code, _, _ in out.values()), report(out)
    losses = [json.loads(x)["loss"] for _, stdout, _ in out.values() for x in stdout.splitlines()]
    assert losses == pytest.approx(want, rel=1e-5)
    logs = "".join(err for _, _, err in out.values())
    groups = set(re.findall(r"collectives of ranks \[([\d, ]+)\]: (shared memory|gloo)", logs))
    assert ("0, 1, 2", "shared memory") in groups and ("3, 4, 5", "shared memory") in groups  # tp, in a host
    assert ("0, 3", "gloo") in groups and ("1, 4", "gloo") in groups  # dp (ZeRO-3), across the hosts


# every rank runs it (SPMD under torchrun); global rank 0 prints the greedy token ids
_MOE_SCRIPT = """
import json, sys
import torch.distributed as dist
from shardlm import LLM, SamplingParams
with LLM(sys.argv[1], dp=4, ep=4, threads=1) as llm:
    out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
if dist.get_rank() == 0:
    print(json.dumps([o.token_ids for o in out]))
"""


def test_moe_generate_with_ep_across_hosts_gives_hfs_tokens(hosts, tmp_path, tmp_path_factory):
    """Qwen3-MoE's experts over ep=4 ranks, two on each host: every MoE layer's all-to-all crosses
    the hosts (gloo), and the greedy tokens are HF's."""
    from harness.moe_reference import cached_tiny_moe
    from harness.reference import NEW_TOKENS, PROMPTS

    ref = cached_tiny_moe("qwen3_moe", tmp_path_factory)
    script = tmp_path / "moe.py"
    script.write_text(_MOE_SCRIPT)
    args = [str(ref.path), json.dumps(PROMPTS), str(NEW_TOKENS)]
    port = next(_ports)
    procs = {h: hosts.torchrun(h, 2, args, port=port, entry=(str(script),)) for h in ("A", "B")}
    out = both(procs, timeout=240)
    assert all(code == 0 for code, _, _ in out.values()), report(out)
    printed = [line for _, stdout, _ in out.values() for line in stdout.splitlines()]
    assert len(printed) == 1 and json.loads(printed[0]) == ref.tokens


@pytest.mark.slow  # ~25 s; make test keeps dp2 tp3 zero3 across the hosts
def test_train_pp2_tp3_zero_bubble_across_hosts_takes_one_hosts_steps(hosts, tiny, tmp_path):
    """A pipeline stage per host (pp across, tp=3 inside) under ZB-H1: the hidden states and their
    gradients cross the hosts point to point, and the losses are one process's."""
    data = tmp_path / "data.txt"
    data.write_text(words(400, seed=2))
    args = ["train", "--model", str(tiny.path), "--data", str(data), "--pp", "2", "--tp", "3"]
    args += ["--pp-schedule", "zb-h1", "--grad-accum", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    want = one_process_losses(str(tiny.path), data.read_text(), 2)
    out = on_both(hosts, 3, [*args, "--threads", "1", "--json"])
    assert all(code == 0 for code, _, _ in out.values()), report(out)
    losses = [json.loads(x)["loss"] for _, stdout, _ in out.values() for x in stdout.splitlines()]
    assert losses == pytest.approx(want, rel=1e-5)


def _kill_b_once_a_prints(hosts: TwoHosts, procs: dict) -> tuple[int, str, float, list[str]]:
    """Kill host B once a host's stdout has output (the run is past start-up: a fixed sleep was not
    enough on a loaded machine, where B died while A still initialised); then host A's (exit status,
    stderr, seconds from the kill to its exit, its `shardlm: error:` lines)."""
    ready = selectors.DefaultSelector()
    for p in procs.values():
        ready.register(p.stdout, selectors.EVENT_READ)
    assert ready.select(timeout=180), "no output within 180 s"
    assert procs["A"].poll() is None, procs["A"].communicate()
    hosts.kill("B")
    start = time.monotonic()
    code, _, err = both({"A": procs["A"]}, timeout=60)["A"]
    return code, err, time.monotonic() - start, [x for x in err.splitlines() if x.startswith("shardlm: error:")]


def test_a_lost_host_ends_generation_with_one_line(hosts, tiny):
    """Host B's processes killed mid-generation: host A's ranks each say which host and ranks
    were lost, within seconds, exit non-zero, and leave no process behind."""
    args = ["generate", "--model", str(tiny.path), "--tp", "2", "--pp", "2", "--no-chat", "--threads", "1"]
    port = next(_ports)
    args += ["--max-new-tokens", "8000", "--timeout", "60", "w1 w2 w3"]
    procs = {h: hosts.torchrun(h, 2, args, port=port) for h in ("A", "B")}
    # generating once global rank 0 (on either host) streams its first text (8000 tokens take a minute)
    code, err, took, lines = _kill_b_once_a_prints(hosts, procs)
    assert code != 0 and took < 10, (took, err[-2000:])
    assert len(lines) >= 1 and all("lost host shardlm-b (192.0.2.2, ranks [2, 3])" in x for x in lines), [
        x for x in err.splitlines() if "rror" in x and "elastic" not in x
    ]
    assert not hosts.pids("A") and not hosts.pids("B")


@pytest.mark.slow  # ~13 s; make test keeps a lost host in generation, serving and a partition in training
def test_a_lost_host_ends_training_mid_step_with_one_line(hosts, tiny, tmp_path):
    """Host B's processes killed between training steps (its rank mid-way into the next): host A's
    rank says which host and ranks were lost within seconds, exits non-zero, and nothing is left."""
    data = tmp_path / "data.txt"
    data.write_text(words(1000, seed=3))
    args = dp2_training(tiny, data)
    port = next(_ports)
    procs = {
        h: hosts.torchrun(h, 1, [*args, "--timeout", "60", "--steps", "100000", "--json"], port=port) for h in "AB"
    }
    code, err, took, lines = _kill_b_once_a_prints(hosts, procs)  # global rank 0 printed its first step
    assert code != 0 and took < 10, (took, err[-2000:])
    assert len(lines) == 1 and "lost host shardlm-b (192.0.2.2, ranks [1])" in lines[0], err[-2000:]
    assert not hosts.pids("A") and not hosts.pids("B")


def test_a_partition_ends_training_within_the_timeout_and_it_resumes(hosts, tiny, tmp_path):
    """The link goes down mid-run (a partition; every process keeps running): both hosts' ranks end
    with one line each within --timeout (plus start-up slack), and the same command resumes from
    the last checkpoint once the link is back."""
    data = tmp_path / "data.txt"
    data.write_text(words(1000, seed=3))
    ckpt = tmp_path / "ckpt"
    args = dp2_training(tiny, data)
    args += ["--timeout", "10", "--checkpoint", str(ckpt), "--checkpoint-every", "2"]
    port = next(_ports)
    procs = {h: hosts.torchrun(h, 1, [*args, "--steps", "100000"], port=port) for h in ("A", "B")}
    deadline = time.monotonic() + 120
    while not (ckpt / "state" / "meta.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (ckpt / "state" / "meta.json").is_file(), f"no checkpoint within 120 s: {both(procs, timeout=1)}"
    hosts.unplug()
    start = time.monotonic()
    out, took = {}, {}
    try:
        for h, wait in (("A", 45), ("B", 5)):  # B's agent is then stopped by the harness (see below)
            out.update(both({h: procs[h]}, timeout=wait))
            took[h] = time.monotonic() - start
        for code, _, err in out.values():
            lines = [x for x in err.splitlines() if x.startswith("shardlm: error:")]
            assert code != 0 and len(lines) == 1 and "did not answer" in lines[0] and "for 10 s" in lines[0], err[
                -2000:
            ]
        # host A (it holds torchrun's rendezvous store) is done within the timeout; host B's ranks
        # stop as soon (their line above), but B's torchrun agent then waits minutes on that store
        # across the cut link (torchrun's own timeouts, measured 167 s): not a shardlm process
        assert took["A"] < 10 + 20, took
    finally:
        hosts.plug()
    saved = json.loads((ckpt / "state" / "meta.json").read_text())["step"]
    again = on_both(hosts, 1, [*args, "--steps", str(saved + 1), "--json"], timeout=180)
    assert all(code == 0 for code, _, _ in again.values()), again
    logs = "".join(err for _, _, err in again.values())
    assert f"resumed from {ckpt} after step {saved}" in logs
    steps = [json.loads(x)["step"] for _, stdout, _ in again.values() for x in stdout.splitlines()]
    assert steps == [saved + 1]


# Runs in the serving host's namespace (the test's own cannot reach 192.0.2.0/24): greedy
# completions of four prompts, then the handoff counter from /metrics; one JSON line.
_CLIENT = """
import json, sys, urllib.request
url, model = sys.argv[1], sys.argv[3]
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
texts = [post("/v1/completions", {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0})
         ["choices"][0]["text"] for p in json.loads(sys.argv[2])]
metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
handoffs = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("shardlm_kv_handoffs_total")]
print(json.dumps({"texts": texts, "handoffs": handoffs}), flush=True)
"""
# a stream that outlives host B (8000 tokens take a minute): its first chunk, then what ends it
_STREAM = """
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps({"model": sys.argv[2], "prompt": "w1 w2 w3",
      "max_tokens": 8000, "temperature": 0, "stream": True, "ignore_eos": True}).encode(), {"content-type": "application/json"})
try:
    for i, line in enumerate(urllib.request.urlopen(req, timeout=120)):
        if i == 0:
            print("streaming", flush=True)
        if b"error" in line:
            print("error event", line.decode().strip(), flush=True)
except Exception as e:
    print("ended:", repr(e), flush=True)
"""


def _serving_url(procs: dict, timeout: float = 240) -> tuple[str, str]:
    """(the host whose global rank 0 serves, its URL without /v1), read from the server's log line."""
    deadline, seen = time.monotonic() + timeout, dict.fromkeys(procs, "")
    ready = selectors.DefaultSelector()
    for h, p in procs.items():
        ready.register(p.stderr, selectors.EVENT_READ, h)
    while time.monotonic() < deadline:
        for key, _ in ready.select(timeout=1):
            seen[key.data] += os.read(key.fileobj.fileno(), 65536).decode(errors="replace")  # as communicate reads
            if m := re.search(r"serving \S+ on (http://\S+)/v1", seen[key.data]):
                return key.data, m.group(1)
        if any(p.poll() is not None for p in procs.values()):
            break
    raise AssertionError(f"no host served within {timeout} s: {seen}")


def test_serve_across_hosts_disaggregated_then_a_lost_host_ends_it(hosts, tiny):
    """`shardlm serve` under torchrun on two hosts, two replicas of tp=2 (one per host) with prefill on
    one and decode on the other: global rank 0's process serves HTTP and drives every rank (the
    other host's over TCP), answers = one process's greedy tokens, and every prompt's KV cache is
    handed across the hosts. Then host B is killed mid-stream: the stream ends with an error, the
    server exits non-zero within seconds with one line, and nothing is left on either host."""
    model = str(tiny.path)
    with LLM(model, threads=1) as llm:
        want = [o.text for o in llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=8))]
    port = next(_ports)
    args = [
        "serve",
        "--model",
        model,
        "--dp",
        "2",
        "--tp",
        "2",
        "--prefill-replicas",
        "1",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    args += ["--threads", "1", "--timeout", "30", "--grace", "1"]
    procs = {h: hosts.torchrun(h, 2, args, port=port) for h in ("A", "B")}
    host, url = _serving_url(procs)
    url = url.replace("0.0.0.0", ADDRESSES[host])
    client = hosts.start(host, [sys.executable, "-c", _CLIENT, url, json.dumps(TEXTS), model])
    out, err = client.communicate(timeout=300)
    assert client.returncode == 0, err
    got = json.loads(out)
    assert got["texts"] == want and got["handoffs"] == [len(TEXTS)]
    other = "B" if host == "A" else "A"
    stream = hosts.start(host, [sys.executable, "-u", "-c", _STREAM, url, model])
    assert stream.stdout.readline().strip() == "streaming"
    hosts.kill(other)
    start = time.monotonic()
    code, _, log = both({host: procs[host]}, timeout=60)[host]
    took = time.monotonic() - start
    rest = stream.communicate(timeout=30)[0]
    assert code != 0 and took < 15, (took, log[-3000:])
    assert "error event" in rest or "ended:" in rest, rest
    lines = [x for x in log.splitlines() if x.startswith("shardlm: error:")]
    assert len(lines) == 1 and "the server stopped (all ranks ended)" in lines[0], log[-3000:]
    deadline = time.monotonic() + 10
    while (hosts.pids("A") or hosts.pids("B")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not hosts.pids("A") and not hosts.pids("B")

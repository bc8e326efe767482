"""`shardlm generate` end to end: its own ranks, torchrun, the JSON contract, bad input, faults."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from harness.cli import BIN, main_exit, shardlm
from shardlm import LLM, SamplingParams
from shardlm.errors import RankFailure

PROMPT = "The capital of France is"


def rank_processes() -> list[str]:
    """Rank processes of this checkout's shardlm on this host (another checkout's runs, and the
    two-host tests' ranks in their own network namespaces, which `make test` runs alongside, are not ours)."""
    out = subprocess.run(["pgrep", "-f", "-a", "shardlm.launch"], capture_output=True, text=True).stdout
    here = os.readlink("/proc/self/ns/net")

    def on_this_host(line: str) -> bool:
        try:
            return os.readlink(f"/proc/{line.split()[0]}/ns/net") == here
        except OSError:  # gone meanwhile
            return False

    return [line for line in out.splitlines() if "pgrep" not in line and str(BIN) in line and on_this_host(line)]


@pytest.fixture(scope="module")
def single_rank_tokens():
    """Greedy tokens of the one-process path (itself checked against HF in test_smollm2)."""
    with LLM("smollm2", threads=1) as llm:
        return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids


@pytest.mark.slow
def test_json_contract_at_tp2(single_rank_tokens):
    r = shardlm(
        "generate", "--tp", "2", "--no-chat", "--json", "--max-new-tokens", "8", "--threads", "1", PROMPT, "Hello"
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 3  # one object per prompt, then timing; logs went to stderr
    first = lines[0]
    assert first["prompt"] == PROMPT and first["token_ids"] == single_rank_tokens
    from shardlm.models.loader import open_checkpoint

    assert first["prompt_tokens"] == len(open_checkpoint("smollm2").tokenizer().encode(PROMPT))
    assert first["completion_tokens"] == len(first["token_ids"]) == 8
    assert lines[1]["prompt"] == "Hello" and lines[1]["token_ids"] != first["token_ids"]
    timing = lines[2]["timing"]
    assert timing["load_s"] > 0 and timing["ttft_s"] > 0 and timing["decode_tok_s"] > 0
    assert len(timing["param_bytes_per_rank"]) == 2
    assert "loading smollm2" in r.stderr
    assert not rank_processes()


@pytest.mark.slow  # ~12 s
def test_streams_a_single_prompt_to_stdout(single_rank_tokens):
    r = shardlm("generate", "--no-chat", "--max-new-tokens", "8", "--threads", "1", PROMPT)
    assert r.returncode == 0, r.stderr
    from shardlm.models.loader import open_checkpoint

    assert r.stdout.strip() == open_checkpoint("smollm2").tokenizer().decode(single_rank_tokens).strip()
    assert "decode" in r.stderr and "decode" not in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "10", "x"], "tp=10 is larger than the model's 9 attention heads"),
        pytest.param(  # ~10 s: the model loads before the prompt is checked
            ["--max-model-len", "8", "--no-chat", "a very long prompt that has more than eight tokens in it"],
            "does not fit the context of 8 tokens",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    """The real command: exit status 2, one error line, no traceback, no rank left behind."""
    r = shardlm("generate", *args, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1
    assert not rank_processes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model", "x"], "not found"),
        (["--max-new-tokens", "0", "x"], "--max-new-tokens 0"),
        (["--temperature", "-1", "x"], "temperature=-1.0"),
        (["--top-p", "0", "x"], "top_p=0.0"),
        (["--dtype", "int8", "x"], "invalid choice"),
        (["--speculative-config", "{ngram", "x"], "'{ngram' is not JSON"),
        (["--speculative-config", '{"method": "eagle"}', "x"], "speculative method='eagle' is not supported"),
        (["--speculative-config", '{"num_speculative_tokens": -1}', "x"], "num_speculative_tokens=-1"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys):
    """Caught before any rank starts: checked in this process (``main_exit``)."""
    code, err = main_exit(["generate", *args], capsys)
    assert code == 2 and message in err, (code, err)
    assert len([line for line in err.splitlines() if "error" in line]) == 1


@pytest.mark.slow  # ~8 s
def test_world_size_mismatch_under_torchrun():
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    r = shardlm("generate", "--tp", "2", "x", env=env, timeout=120)
    assert r.returncode == 2 and "needs 2 ranks but the world has 3" in r.stderr
    assert "tp=3" in r.stderr  # a valid alternative is named


@pytest.mark.slow  # ~8 s
def test_unknown_architecture(tmp_path):
    """An architecture shardlm does not know: one line naming the ones it runs (and GPT-2's, which
    only the planner costs)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    r = shardlm("generate", "--model", str(tmp_path), "x", timeout=120)
    assert r.returncode == 2 and "unknown architecture ['FalconForCausalLM']; shardlm runs " in r.stderr
    assert "LlamaForCausalLM" in r.stderr and "(the planner also GPT2LMHeadModel)" in r.stderr


def test_a_killed_rank_ends_the_run_with_a_message():
    """Rank 1 is killed mid-generation: the driver raises within seconds, naming it and its signal (also
    where rank 0's report that it lost its peer comes first), and no rank survives."""
    llm = LLM("smollm2", tp=2, threads=1)
    victim = llm._ranks.procs[1]
    seen = []

    def kill_after_two(i, token):
        seen.append(token)
        if len(seen) == 2:
            victim.kill()

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died \(killed by SIGKILL\)"):
        llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), on_token=kill_after_two)
    assert time.monotonic() - start < 60
    assert len(seen) < 200
    assert all(p.poll() is not None for p in llm._ranks.procs) if llm._ranks else True
    assert not rank_processes()


@pytest.mark.slow
def test_python_api_needs_no_main_guard(tmp_path):
    """Ranks are not spawned by re-running the caller's script, so a plain script works."""
    script = tmp_path / "plain.py"
    script.write_text(
        "from shardlm import LLM, SamplingParams\n"
        "llm = LLM('smollm2', tp=2, threads=1)\n"
        f"print(llm.generate({PROMPT!r}, SamplingParams(max_tokens=4))[0].token_ids)\n"
        "llm.close()\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])) == 4


@pytest.mark.slow
def test_runs_unchanged_under_torchrun(single_rank_tokens):
    r = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardlm.cli",
            "generate",
            "--tp",
            "2",
            "--no-chat",
            "--json",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            PROMPT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2  # rank 0 alone prints: one result and the timing line
    assert lines[0]["token_ids"] == single_rank_tokens


# every torchrun rank runs it: `train` through the CLI's entry point, with an exit handler that
# reports whether interpreter teardown was reached
_LEAVES = """
import atexit, sys
atexit.register(lambda: print("interpreter teardown", file=sys.stderr))
from shardlm.cli import main
model, data = sys.argv[1:3]
sys.exit(main(["train", "--model", model, "--data", data, "--tp", "2", "--steps", "1", "--batch-size", "1",
               "--seq-len", "8", "--threads", "1", "--json"]))
"""


@pytest.mark.slow
def test_a_torchrun_rank_leaves_without_interpreter_teardown(tiny, tmp_path):
    """A gloo group left to interpreter teardown can abort its process after the work is done
    ("terminate called without an active exception"), failing a torchrun run that succeeded and
    leaving the other hosts' agents in torchrun's exit barrier (the two-host tests' flake under
    load). So a torchrun rank whose group shardlm started leaves with its exit code once the
    command is done (launch.leave): its output flushed, no exit handler run."""
    from harness.reference import word_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny("llama").path, model)
    word_tokenizer(model, 251)
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"w{i % 200}" for i in range(200)))
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    run = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script), str(model), str(data)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(line)["step"] for line in r.stdout.splitlines()] == [1]  # flushed before leaving
    assert "interpreter teardown" not in r.stderr, r.stderr[-3000:]


# every torchrun rank runs it: an LLM and a Trainer left open, as a user's script may leave them; an
# exit handler registered first (so run last) reports the process's threads against those before
_ENDS = """
import atexit, os, sys
import torch
from shardlm import LLM, SamplingParams
from shardlm.train.trainer import Trainer, TrainConfig
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
report = open(os.path.join(sys.argv[2], os.environ["RANK"]), "w")
atexit.register(lambda: report.write(f"threads {before} {threads()}\\n"))
llm = LLM(sys.argv[1], dp=2, threads=1)
tokens = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
trainer = Trainer(TrainConfig.of(model=sys.argv[1], dp=2, zero=3, threads=1), rank=int(os.environ["RANK"]),
                  world=2, init_method="env://")
trainer.step(torch.randint(0, 200, (2, 8)))
report.write(f"tokens {len(tokens)}\\n")
if sys.argv[3] == "destroys":  # as torch's docs tell a script to end
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["leaves", "destroys"])
def test_a_users_torchrun_script_ends_the_group_shardlm_started_before_teardown(tiny, tmp_path, ending):
    """A user's script under torchrun (not the CLI, which leaves by os._exit) ends through
    interpreter teardown; a gloo worker still freeing a collective's tensors there aborts the process
    ("terminate called without an active exception"; the two-host MoE test's failure in CI). So at
    exit shardlm closes what holds the mesh of the group it started (an LLM, a Trainer, left open
    here) and destroys the group: every gloo thread is joined before teardown. Without that, 27
    more threads than before the LLM were still running at exit; with the group destroyed but the
    LLM and Trainer still holding their meshes, 24; with the script destroying the group itself
    (``destroys``) and the holders not closed, 24 too."""
    script = tmp_path / "ends.py"
    script.write_text(_ENDS)
    run = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script), str(tiny("llama").path)]
    r = subprocess.run([*run, str(tmp_path), ending], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in ("0", "1"):
        tokens, threads = (tmp_path / rank).read_text().splitlines()
        assert tokens == "tokens 3"
        before, at_exit = threads.split()[1:]
        assert at_exit == before, f"rank {rank}: {before} threads before the LLM, {at_exit} at exit"


def test_unknown_architecture_in_process(tmp_path, capsys):
    """The same refusal, caught before any rank starts (the real command is run by the slow test
    above)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    code, err = main_exit(["generate", "--model", str(tmp_path), "x"], capsys)
    assert code == 2 and "unknown architecture ['FalconForCausalLM']; shardlm runs " in err, err
    assert "LlamaForCausalLM" in err and "(the planner also GPT2LMHeadModel)" in err

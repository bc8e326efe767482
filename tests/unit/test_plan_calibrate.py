"""Calibration of this machine: a quick measurement, its cache, and a plan that uses it."""

import json

import pytest

from shardlm.plan import calibrate as cal
from shardlm.plan.cli import main


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SHARDLM_CACHE_DIR", str(root))
    data = cal.calibrate(quick=True)
    yield root, data
    mp.undo()


def test_measures_and_caches(cache, monkeypatch):
    root, data = cache
    monkeypatch.setenv("SHARDLM_CACHE_DIR", str(root))
    assert (root / "calibration.json").exists()
    one = data["threads"]["1"]
    assert one["matmul_flops"]["fp32"] > 1e8 and one["matvec_Bps"]["fp32"] > 1e8
    assert 0 < one["op_overhead_s"] < 1e-2
    fit = data["pair"]["allreduce_fit"]
    assert 0 < fit["a_s"] < 0.1 and fit["b_s_per_byte"] > 0
    # a second call reads the cache instead of measuring
    (root / "calibration.json").write_text(json.dumps({**data, "marker": 1}))
    assert cal.calibrate()["marker"] == 1


def test_machine_spec_shares_cores(cache):
    _, data = cache
    one, two = cal.machine_spec(1, data), cal.machine_spec(2, data)
    assert two.memory_bytes == pytest.approx(one.memory_bytes / 2)
    assert one.intra.alpha_s > 0 and one.op_overhead_s > 0
    three = cal.machine_spec(3 * data["cores"], data)  # oversubscribed: ranks take turns
    assert three.mem_Bps < two.mem_Bps


def test_plan_this_machine(cache, monkeypatch, capsys):
    root, _ = cache
    monkeypatch.setenv("SHARDLM_CACHE_DIR", str(root))
    assert main(["--model", "smollm2", "--gpu", "this-machine", "--gpus", "2", "--batch", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == "this-machine" and data["workload"]["dtype"] == "fp32"
    assert {(x["layout"]["tp"], x["layout"]["pp"]) for x in data["layouts"]} >= {(2, 1), (1, 2)}
    assert all(x["tpot_s"] > 0 for x in data["layouts"])
    # the two ranks share the machine's memory
    assert all(x["memory_bytes"]["total"] <= cal.calibrate()["memory_bytes"] / 2 for x in data["layouts"])

"""The served benchmark's own logic (no server started): options, the ideal hit count, metrics,
summaries and saved results. The figures themselves come from benches/bench_served.py runs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = os.path.join(HERE, "..", "benches")
sys.path.insert(0, BENCHES)

import bench_served as bs  # noqa: E402


def test_rounds_option():
    assert bs._rounds("3") == {"*": 3}
    assert bs._rounds("tiny=4,real=3") == {"tiny": 4, "real": 3}
    assert bs._rounds("2,real=1") == {"*": 2, "real": 1}
    for bad in ("", "x", "tiny=0", "-1", "huge=3", "tiny=", "tiny=1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            bs._rounds(bad)


def test_ideal_counts_shared_full_blocks_and_the_eagle_successor():
    b = bs.BLOCK
    p = list(range(1, 3 * b + 6))  # 3 full blocks and 5 more tokens
    # Second copy: every full block shared; the token after the third is the same too.
    assert bs.ideal_cached_tokens([p, list(p)], eagle=False) == 3 * b
    assert bs.ideal_cached_tokens([p, list(p)], eagle=True) == 3 * b
    # Same 3 blocks, another token right after them: EAGLE cannot serve the third.
    q = p[: 3 * b] + [9999] + p[3 * b + 1:]
    assert bs.ideal_cached_tokens([p, q], eagle=False) == 3 * b
    assert bs.ideal_cached_tokens([p, q], eagle=True) == 2 * b
    # The block holding the prompt's last token is never served.
    r = p[: 2 * b]
    assert bs.ideal_cached_tokens([p, r], eagle=False) == 1 * b
    assert bs.ideal_cached_tokens([[5] * b], eagle=False) == 0


def test_parse_metrics_sums_engines_and_splits_sources():
    text = "\n".join([
        "# HELP vllm:prompt_tokens_total x",
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 50.0',
        'vllm:prompt_tokens_created{engine="0"} 1.7e9',
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 64.0',
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 32.0',
        'vllm:num_preemptions_total{engine="0"} NaN',
        "not_vllm_metric 5",
    ])
    m = bs.parse_metrics(text)
    assert m["vllm:prompt_tokens"] == 150.0
    assert m["vllm:prompt_tokens_cached_by_source{host}"] == 64.0
    assert m["vllm:prompt_tokens_cached_by_source{device}"] == 32.0
    assert "vllm:prompt_tokens_created" not in m and "not_vllm_metric" not in m


def _run(mode, seed, tps, ttft, host=0.0, dev=0.0, failed=0):
    return {"mode": mode, "seed": seed, "output_tps": tps, "mean_ttft_ms": ttft,
            "host_tokens": host, "device_tokens": dev, "failed": failed}


def test_summary_pairs_rounds_by_seed(tmp_path):
    runs = [_run("none", 0, 100, 1000, 0, 50), _run("kvslots", 0, 110, 500, 100, 40),
            _run("kvslots", 1, 90, 800, 120, 30, failed=1), _run("none", 1, 100, 1000, 0, 60)]
    s = bs.summarize("tiny", runs, {0: 150, 1: 160})
    assert s["tps_ratios"] == pytest.approx([1.1, 0.9])
    assert s["ttft_ratios"] == pytest.approx([0.5, 0.8])
    assert s["hit_vs_ideal"] == pytest.approx([140 / 150, 150 / 160])
    assert s["kvslots"]["failed"] == 1 and s["none"]["failed"] == 0
    assert s["kvslots"]["tps_range"] == (90, 110)
    # Saved, then read back by --from-json with another file's model merged in.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    bs._save({"runs": {"tiny": runs}, "summary": {"tiny": s}}, str(a))
    s_real = bs.summarize("real", [_run("none", 0, 10, 9000), _run("kvslots", 0, 22, 3000)], {0: 0})
    bs._save({"runs": {"real": []}, "summary": {"real": s_real}}, str(b))
    assert not os.path.exists(str(a) + ".tmp")
    p = subprocess.run([sys.executable, os.path.join(BENCHES, "bench_served.py"), "--from-json", str(a), str(b)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "== tiny" in p.stdout and "== real" in p.stdout
    assert "output tok/s 1.000x (0.900-1.100)" in p.stdout
    assert "output tok/s 2.200x" in p.stdout
    json.loads(a.read_text())


def test_slot_manager_is_always_passed(tmp_path, monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append(cmd)

    monkeypatch.setattr(bs.subprocess, "Popen", FakePopen)
    models = {"target": "/m/t", "eagle": "/m/e"}
    base = dict(host_cache_gb=1.0, max_num_seqs=16, env=None, env_none=None, env_kvslots=None, profile=None)
    for given, mode in (("vllm", "none"), ("vllm", "kvslots"), ("kvslots", "kvslots"), ("kvslots", "none")):
        args = argparse.Namespace(slot_manager=given, **base)
        bs.Server(models, mode, args, str(tmp_path / "log"))
        cmd = started[-1]
        serve_args = cmd[: cmd.index("--")]
        i = serve_args.index("--slot-manager")
        assert serve_args[i + 1] == given
        assert ("--no-connector" in serve_args) == (mode == "none")
    monkeypatch.setattr(sys, "argv", ["bench_served.py", "--slot-manager", "bogus"])
    with pytest.raises(SystemExit) as e:
        bs.main()
    assert e.value.code == 2


def _posrun(mode, rnd, position, tps, ttft):
    return {**_run(mode, 0, tps, ttft), "round": rnd, "position": position}


def test_summary_pairs_by_round_and_balances_the_position_effect():
    # Same seed every round (--same-seed); true ratio 1.2, the first server of a round 10% slower.
    f, runs = 0.9, []
    for rnd in range(4):
        first = "none" if rnd % 2 == 0 else "kvslots"
        tps = {"none": 100.0, "kvslots": 120.0}
        ttft = {"none": 1000.0, "kvslots": 800.0}
        for pos, mode in enumerate((first, "kvslots" if first == "none" else "none")):
            slow = f if pos == 0 else 1.0
            runs.append(_posrun(mode, rnd, pos, tps[mode] * slow, ttft[mode] / slow))
    s = bs.summarize("tiny", runs, {0: 1})
    assert len(s["tps_ratios"]) == 4  # paired by round, not every none x every kvslots of the seed
    assert s["tps_ratios_none_first"] == pytest.approx([1.2 / f] * 2)
    assert s["tps_ratios_kvslots_first"] == pytest.approx([1.2 * f] * 2)
    assert s["first_over_second_tps"] == pytest.approx([f * 100 / 120, f * 120 / 100] * 2)
    assert s["tps_balanced"] == pytest.approx(1.2) and s["ttft_balanced"] == pytest.approx(0.8)
    # One position only: no balanced ratio.
    s1 = bs.summarize("tiny", [r for r in runs if r["round"] == 0], {0: 1})
    assert s1["tps_balanced"] is None and s1["tps_ratios"] == pytest.approx([1.2 / f])


def test_stop_waits_for_the_whole_process_group(tmp_path):
    # A leader that exits at once and a child of its group that outlives it by a second.
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.0)'])"],
                         start_new_session=True)
    p.wait(30)
    import time

    t0 = time.time()
    assert bs._wait_group_gone(p.pid, 30)
    assert time.time() - t0 > 0.3  # it waited for the child
    assert bs._wait_group_gone(p.pid, 0.1)  # gone: at once


def test_order_option():
    assert bs._order("kvslots,kvslots,none,none") == ["kvslots", "kvslots", "none", "none"]
    for bad in ("", "none", "none,none,kvslots", "none,bogus", "kvslots,,kvslots"):
        with pytest.raises(argparse.ArgumentTypeError):
            bs._order(bad)


def test_schedule_default_alternates_and_order_pairs_the_ith_runs():
    assert bs.schedule(None, 2, ["none", "kvslots"]) == [
        (0, 0, "none"), (0, 1, "kvslots"), (1, 0, "kvslots"), (1, 1, "none")]
    # Forced order: the i-th run of each mode is round i; position 0 when it ran first.
    assert bs.schedule(["kvslots", "kvslots", "none", "none"], 2, ["none", "kvslots"]) == [
        (0, 0, "kvslots"), (1, 0, "kvslots"), (0, 1, "none"), (1, 1, "none")]
    assert bs.schedule(["none", "kvslots", "kvslots", "none"], 2, ["none", "kvslots"]) == [
        (0, 0, "none"), (0, 1, "kvslots"), (1, 0, "kvslots"), (1, 1, "none")]


def test_thread_cpu_samples_a_process_tree(tmp_path):
    # A child in its own group that burns CPU on a named thread: it shows up under its name.
    code = ("import threading, time\n"
            "def spin():\n"
            "    t = time.process_time() + 0.5\n"
            "    while time.process_time() < t: pass\n"
            "    time.sleep(30)\n"
            "th = threading.Thread(target=spin, name='burner'); th.start()\n"
            "th.join()\n")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        import time
        deadline = time.time() + 20
        while time.time() < deadline:
            cpu = bs.thread_cpu(p.pid)
            if sum(cpu.values()) >= 0.4:
                break
            time.sleep(0.1)
        assert bs.process_tree(p.pid) == [p.pid]
        assert sum(cpu.values()) >= 0.4
        assert all(k.count("/") >= 1 for k in cpu)
        assert bs.cpu_delta({"a/x": 1.0}, {"a/x": 1.5, "a/y": 0.0, "b/z": 2.0}) == {"a/x": 0.5, "b/z": 2.0}
    finally:
        p.kill()
        p.wait()
    assert bs.thread_cpu(p.pid) == {}


def test_baseline_mode_serves_the_other_checkout_with_the_same_cores(tmp_path, monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append((cmd, kw["env"]))

    monkeypatch.setattr(bs.subprocess, "Popen", FakePopen)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    old = tmp_path / "old"
    (old / "python" / "kvslots").mkdir(parents=True)
    (old / "python" / "kvslots" / "serve.py").write_text('p.add_argument("--host-cache-gb")\n')  # no --slot-manager
    args = argparse.Namespace(slot_manager="vllm", host_cache_gb=1.0, max_num_seqs=16, env=None, env_none=None,
                              env_kvslots=None, profile=None, baseline_root=str(old))
    bs.Server({"target": "/m/t", "eagle": "/m/e"}, "baseline", args, str(tmp_path / "log"))
    cmd, env = started[-1]
    assert "--slot-manager" not in cmd and "--no-connector" not in cmd and "--host-cache-gb" in cmd
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.join(str(old), "python")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    bs.Server({"target": "/m/t", "eagle": "/m/e"}, "kvslots", args, str(tmp_path / "log"))
    cmd, env = started[-1]  # today's connector server: its own tree, and kvslots serve sets the reservation
    assert "--slot-manager" in cmd and env["PYTHONPATH"].split(os.pathsep)[0] == os.path.join(bs.ROOT, "python")


def test_three_modes_rotate_and_summarize_against_the_baseline(monkeypatch):
    modes = ("none", "baseline", "kvslots")
    monkeypatch.setattr(bs, "MODES", modes)
    plan = bs.schedule(None, 3, list(modes))
    firsts = [m for rnd, pos, m in plan if pos == 0]
    assert sorted(firsts) == sorted(modes) and len(plan) == 9  # each mode first once in 3 rounds
    tps = {"none": 100.0, "baseline": 80.0, "kvslots": 104.0}
    runs = [{**_run(m, rnd, tps[m], 1000.0 / tps[m] * 100, 10, 10), "round": rnd, "position": pos}
            for rnd, pos, m in plan]
    s = bs.summarize("tiny", runs, {0: 20, 1: 20, 2: 20})
    assert s["tps_ratios"] == pytest.approx([1.04] * 3)
    assert s["tps_ratios_baseline_none"] == pytest.approx([0.8] * 3)
    assert s["tps_ratios_kvslots_baseline"] == pytest.approx([1.3] * 3)
    assert s["hit_vs_ideal_baseline"] == pytest.approx([1.0] * 3)

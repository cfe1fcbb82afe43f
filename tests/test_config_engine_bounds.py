"""What reading an engine's configuration costs, within the loader's limits: a TRT-LLM engine YAML
(``kvslots convert-config``, ``kvslots serve --extra-engine-args``) or vLLM's ``--config`` file
after ``--`` is held to :data:`kvslots.config.loader.MAX_ENGINE_NODES` nodes (100,000 small keys,
500 KB, took 3-4 s to read and convert and were accepted), and converting keys full of dots costs
what the keys are long (3,900 keys of 1,000 dots took 10 s and 2.4 GB)."""

from __future__ import annotations

import tracemalloc

import pytest

from kvslots import cli
from kvslots.config.loader import MAX_ENGINE_NODES, MAX_NODES, parse_yaml
from kvslots.config.trtllm import convert_trtllm_config, parse_trtllm_yaml
from kvslots.errors import ConfigError, KVSlotsError
from kvslots.serve.cli import plan_from_argv

#: 30,000 keys (60,000 nodes): within MAX_NODES, past MAX_ENGINE_NODES.
MANY_KEYS = "".join(f"k{i}: 0\n" for i in range(30_000))


def test_an_engine_yaml_past_the_engine_node_limit_is_refused(tmp_path, capsys):
    assert MAX_ENGINE_NODES < 30_000 * 2 < MAX_NODES
    f = tmp_path / "e.yaml"
    f.write_text(MANY_KEYS)
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"more than {MAX_ENGINE_NODES} nodes; not a configuration file" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=f"more than {MAX_ENGINE_NODES} nodes"):
        parse_trtllm_yaml(MANY_KEYS)
    with pytest.raises(ConfigError, match=f"more than {MAX_ENGINE_NODES} values"):  # given in code, the same rule
        convert_trtllm_config({f"k{i}": 0 for i in range(60_000)})
    assert len(parse_yaml(MANY_KEYS)) == 30_000  # other files keep the general limit


@pytest.mark.parametrize("where", ["extra-engine-args", "vllm-config"])
def test_kvslots_serve_holds_engine_files_to_the_engine_node_limit(tmp_path, where):
    f = tmp_path / "e.yaml"
    f.write_text(MANY_KEYS)
    argv = ["org/m", "--extra-engine-args", str(f)] if where == "extra-engine-args" else ["org/m", "--", "--config", str(f)]
    with pytest.raises(KVSlotsError, match=f"more than {MAX_ENGINE_NODES} nodes"):
        plan_from_argv(argv)


def test_a_large_real_engine_yaml_still_converts():
    # Every CUDA-graph batch size up to 2048, a draft_len_schedule and a few hundred other keys:
    # more than any real engine YAML holds, well within the limit.
    text = ("max_batch_size: 2048\nmax_num_tokens: 8192\n"
            "cuda_graph_config:\n  max_batch_size: 2048\n  batch_sizes: [" + ", ".join(map(str, range(1, 2049))) + "]\n"
            "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n"
            "  draft_len_schedule: {" + ", ".join(f"{i}: {4 if i < 64 else 2}" for i in range(1, 129)) + "}\n"
            + "".join(f"extra_{i}: {i}\n" for i in range(300)))
    r = convert_trtllm_config(parse_trtllm_yaml(text))
    assert r.engine_args["max_num_seqs"] == 2048
    assert sum(line.startswith("unknown: extra_") for line in r.notes()) == 300


def test_converting_keys_full_of_dots_costs_what_they_are_long():
    # Unknown keys (reported by the sweep) of 1,000 dots each: every prefix of every key ending
    # before a dot was kept in a set, keys x dots strings (1,000 keys: ~250 MB).
    doc = {f"{i:04d}" + "." * 1000: 0 for i in range(1000)}
    tracemalloc.start()
    try:
        r = convert_trtllm_config(doc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, peak
    assert sum(line.startswith("unknown: ") for line in r.notes()) == 1000
    # The sweep still reports a null or empty value no handler recorded, and a section whose
    # keys were recorded is not reported as empty.
    r = convert_trtllm_config({"kv_cache_config": {"free_gpu_memory_fraction": 0.5, "host_cache_size": None},
                               "cuda_graph_config": {"batch_sizes": None}, "moe_config": {}})
    assert sorted(i.path for i in r.ignored if "null or empty" in i.reason) == [
        "cuda_graph_config.batch_sizes", "kv_cache_config.host_cache_size", "moe_config"]


def test_a_wide_ep_engine_yaml_with_inline_slot_assignments_converts():
    """TRT-LLM's wide-EP configs list the MoE load balancer's initial slot assignments inline:
    DeepSeek-V3's 58 MoE layers of 288 slots are 16.7k nodes (192 KB), refused when the engine
    limit was 10,000. A 61-layer model of 384 slots (23.5k) is read too."""
    import yaml

    for layers, slots in ((range(3, 61), 288), (range(61), 384)):
        doc = {"max_batch_size": 256, "max_num_tokens": 8192,
               "moe_config": {"backend": "WIDEEP", "load_balancer": {
                   "num_slots": slots,
                   "initial_global_assignments": {i: [j % 256 for j in range(slots)] for i in layers}}}}
        text = yaml.safe_dump(doc)
        assert parse_trtllm_yaml(text, "wide_ep.yaml") == doc
        convert_trtllm_config(parse_trtllm_yaml(text, "wide_ep.yaml"))

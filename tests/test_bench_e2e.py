"""`specserve bench e2e`: its --spec syntax, and a CPU run on the default model whose
speculative rows (float32, greedy) reproduce the plain engine's tokens."""

from __future__ import annotations

import json
import types

import pytest

from specserve.bench.e2e import parse_spec
from specserve.errors import InvalidArgument
from tests.engine_utils import TINY


def test_spec_values_map_to_engine_arguments():
    label, kw = parse_spec("8,8,48", "EAGLE", "/d")
    assert label == "specserve-eagle steps=8 topk=8 n=48"
    assert kw == dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/d",
                      speculative_num_steps=8, speculative_eagle_topk=8,
                      speculative_num_draft_tokens=48)  # fmt: skip
    label, kw = parse_spec("5,4,16:/maps/m.json+1024", "EAGLE", None)
    assert label.endswith("map=m.json+1024")
    assert kw["speculative_token_map"] == "/maps/m.json"
    assert kw["speculative_token_map_growth"] == 1024
    _, kw = parse_spec("5,4,16:/maps/a+b.json", "EAGLE", None)  # '+' inside a file name
    assert kw["speculative_token_map"] == "/maps/a+b.json"
    assert "speculative_token_map_growth" not in kw
    # a chain's label and arguments say the size the engine runs: num_steps + 1
    label, kw = parse_spec("3,1,99", "EAGLE", None)
    assert label.endswith("n=4") and kw["speculative_num_draft_tokens"] == 4
    for bad in ("8,8", "8,x,48", ""):
        with pytest.raises(InvalidArgument, match="--spec.*steps,topk,num_draft_tokens"):
            parse_spec(bad, "EAGLE", None)


def test_rounds_alternate_the_engines_and_report_each_rows_median(monkeypatch, capsys):
    """--rounds 3: plain and speculative engines take turns (so drift over a process is shared),
    each row's tok/s is the median of its rounds, its accept length their mean, its
    same_tokens counts every round's outputs, and the table prints rows without them."""
    import argparse

    from specserve.bench import e2e

    order, speeds = [], {"specserve": iter([100.0, 90.0, 80.0]), "spec": iter([250, 150, 200])}
    spec_accepts = iter([3.0, 4.0, 5.0])

    def fake_run(kwargs, texts, prompt_ids, args):
        key = "spec" if "speculative_num_steps" in kwargs else "specserve"
        order.append(key)
        outs = [[1] * 50, [2] * 50]  # 100 tokens
        if key == "spec" and order.count("spec") == 2:
            outs = [[1] * 50, [2] * 49 + [3]]  # the second round decodes one answer differently
        accept = next(spec_accepts) if key == "spec" else None
        return 100 / next(speeds[key]), outs, accept, [[0]]

    monkeypatch.setattr(e2e, "_run_engine", fake_run)
    monkeypatch.setattr(e2e, "free_device_memory", lambda: None)
    args = argparse.Namespace(model_path="m", device="cpu", dtype="float32", algorithm="EAGLE",
                              draft="/d", spec=["2,1,3"], rounds=3)  # fmt: skip
    rows, _, _ = e2e._engine_rows(args, ["a", "b"])
    assert order == ["specserve", "spec"] * 3
    assert [r["tok_s"] for r in rows] == pytest.approx([90.0, 200.0])
    assert rows[1]["tok_s_rounds"] == [250.0, 150.0, 200.0]
    assert rows[0]["same_tokens"] == 1.0 and rows[0]["accept_length"] is None
    assert rows[1]["same_tokens"] == pytest.approx(5 / 6) and rows[1]["accept_length"] == 4.0
    e2e.dump(rows + [{"system": "hf", "tok_s": 30.0}])
    assert "hf | 30 | None" in capsys.readouterr().out


@pytest.mark.slow
def test_e2e_runs_every_row_and_speculation_keeps_the_tokens(tmp_path):
    from specserve.cli import main
    from specserve.speculative.token_map import save_token_map

    save_token_map(str(tmp_path / "map.json"), list(range(2000)))
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--device", "cpu", "--dtype", "float32", "--skip-hf",
               "--num-prompts", "1", "--max-new-tokens", "6",
               "--spec", "2,1,3", f"2,2,4:{tmp_path / 'map.json'}+64",
               "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == [
        "specserve",
        "specserve-eagle steps=2 topk=1 n=3",
        "specserve-eagle steps=2 topk=2 n=4 map=map.json+64",
    ]
    for r in rows:
        assert r["output_tokens"] > 0 and r["tok_s"] > 0
        assert r["same_tokens"] == 1.0  # float32 on the CPU: lossless to the token
    assert all(r["accept_length"] >= 1.0 for r in rows[1:])


@pytest.mark.slow
def test_one_batch_on_chat_prompts_measures_the_bundled_drafts_acceptance(tmp_path):
    """`bench one-batch --chat`: the packaged prompts as chats, the default model with its
    bundled draft, so the row reports a real draft's acceptance."""
    from specserve.cli import main

    out = tmp_path / "rows.json"
    rc = main(["bench", "one-batch", "--chat", "--device", "cpu", "--batch-size", "1", "3",
               "--input-len", "7", "--output-len", "12", "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["input_len"] > 7  # a chat template around a real prompt, not --input-len
        assert r["decode_throughput_tok_s"] > 0 and r["spec_accept_length"] > 1.0


class _CapturingEngine:
    """Stands in for an engine whose runs capture a scripted number of new CUDA graphs."""

    def __init__(self, captures_per_run: list[int], idle_captures_per_run: list[int] = ()):
        self.script = list(captures_per_run)
        self.idle_script = list(idle_captures_per_run)
        self.captures = self.idle_captures = 0
        self.core = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=100))

    def generate(self, input_ids, sampling_params):
        self.captures += self.script.pop(0) if self.script else 0
        # (what the run left to capture when idle: captured before stats() is read)
        self.idle_captures += self.idle_script.pop(0) if self.idle_script else 0
        n = sampling_params["max_new_tokens"]
        meta = {"ttft": 0.01, "completion_tokens": n}
        return [{"output_ids": [5] * n, "meta_info": meta} for _ in input_ids]

    def flush_cache(self):
        return 0

    def stats(self):
        return {
            "num_graph_captures": self.captures,
            "num_graph_captures_idle": self.idle_captures,
            "num_graph_captures_wanted": 0,
            "speculative_adaptive": None,
        }


@pytest.mark.parametrize(
    "script,idle,warmups,timed",
    [
        ([0, 0], [], 1, 0),
        ([4, 0, 0], [], 2, 0),
        ([4, 2, 0, 0], [], 3, 0),
        ([4, 2, 1, 1], [], 3, 1),
        ([0, 0, 0], [3, 0], 2, 0),  # shapes run eagerly, captured only while idle
    ],
)
def test_one_batch_warms_up_until_no_graph_is_captured_and_reports_any_left(
    script, idle, warmups, timed
):
    from specserve.bench.one_batch import run_one_batch

    row = run_one_batch(_CapturingEngine(script, idle), 2, 8, 4)
    assert (row["warmup_runs"], row["graph_captures_timed"]) == (warmups, timed)


def test_one_batch_repeats_its_timed_run_and_reports_the_median():
    from specserve.bench.one_batch import run_one_batch

    row = run_one_batch(_CapturingEngine([0, 0]), 2, 8, 4, repeats=3)
    runs = row["decode_throughput_runs"]
    assert len(runs) == 3
    assert round(row["decode_throughput_tok_s"], 1) == sorted(runs)[1]
    assert "decode_throughput_runs" not in run_one_batch(_CapturingEngine([0, 0]), 2, 8, 4)
    two = run_one_batch(_CapturingEngine([0, 0]), 2, 8, 4, repeats=2)  # never the best of two
    assert round(two["decode_throughput_tok_s"], 1) == min(two["decode_throughput_runs"])


def test_one_batch_reports_the_garbage_collections_of_its_timed_run():
    """A collection inside the timed run shows up in its row, by generation and pause."""
    import gc

    from specserve.bench.one_batch import run_one_batch

    class Collecting(_CapturingEngine):
        def generate(self, input_ids, sampling_params):
            gc.collect()  # (a full collection, as the loop's own allocations may trigger)
            return super().generate(input_ids, sampling_params)

    row = run_one_batch(Collecting([0, 0]), 2, 8, 4)
    assert row["gc_collections"][2] >= 1 and row["gc_pause_ms"] > 0.0
    quiet = run_one_batch(_CapturingEngine([0, 0]), 2, 8, 4)
    assert quiet["gc_collections"][2] == 0  # only what ran while timing is counted


def test_one_batch_reports_the_adaptive_steps_device_time_of_its_timed_run(tmp_path):
    """Under adaptive speculation the row gives the timed run's summed step times, to set
    against its wall time (here on a CPU, where a step's time is the host's clock)."""
    from specserve import Engine
    from specserve.bench.one_batch import run_one_batch

    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny",
                speculative_num_steps=2, speculative_eagle_topk=2,
                speculative_num_draft_tokens=4, speculative_adaptive=True)  # fmt: skip
    with Engine(**TINY, **spec) as e:
        row = run_one_batch(e, 2, 16, 12)
        total = e.stats()["speculative_adaptive"]["device_seconds"]
    assert 0.0 < row["adaptive_step_device_s"] <= row["decode_latency_s"] + row["prefill_latency_s"]
    assert row["adaptive_step_device_s"] < total  # the warm-up's steps are not counted


def test_one_batch_chat_warm_up_runs_other_prompts_at_the_timed_lengths():
    """The chat warm-up's prompts differ from the timed ones but have their lengths (cut or
    repeated), so the timed run meets no prefill shape or context width it has not met."""
    from specserve.bench.one_batch import same_lengths

    timed = [[1] * 5, [2] * 9, [3] * 2]
    others = [[7, 8, 9], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [6]]
    warm = same_lengths(others, timed)
    assert [len(w) for w in warm] == [5, 9, 2]
    assert warm[0] == [7, 8, 9, 7, 8] and warm[1] == others[1][:9] and warm[2] == [6, 6]
    with pytest.raises(ValueError):
        same_lengths(others[:2], timed)
    assert same_lengths([[4, 5]], [[]]) == [[]]

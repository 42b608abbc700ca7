"""bench/serving_vs_vllm.sh's pieces on a CPU: the table from result files in the format
`vllm bench serve --save-result` writes (vLLM 0.26's vllm/benchmarks/serve.py), specserve's
speculation counters read from a live server, and the inputs written for vLLM's client (the
custom-dataset prompt file, the tokenizer folder)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench.serving_vs_vllm import (
    accept_length,
    comparison_rows,
    engine_deltas,
    fetch_counters,
    format_table,
    load_results,
)
from bench.vllm_bench_inputs import packaged_prompts, write_prompt_file, write_tokenizer_folder
from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.test_server import TINY, ServerThread


def vllm_result(ttft: float, tpot: float, tok_s: float, **extra) -> dict:
    """A result file as vLLM's client saves it (without --save-detailed)."""
    out = {
        "date": "20261201-120000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": "smollm2-135m",
        "tokenizer_id": "/tmp/tok",
        "num_prompts": 32,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 1,
        "duration": 8192 / tok_s,
        "completed": 32,
        "failed": 0,
        "total_input_tokens": 8192,
        "total_output_tokens": 8192,
        "request_throughput": 32 * tok_s / 8192,
        "request_goodput": None,
        "output_throughput": tok_s,
        "total_token_throughput": 2 * tok_s,
        "max_output_tokens_per_s": tok_s * 1.1,
        "max_concurrent_requests": 1,
        "rtfx": 0.0,
        "mean_ttft_ms": ttft,
        "median_ttft_ms": ttft,
        "std_ttft_ms": 0.1,
        "p99_ttft_ms": ttft * 2,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "std_tpot_ms": 0.01,
        "p99_tpot_ms": tpot * 2,
        "mean_itl_ms": tpot * 3,
        "median_itl_ms": tpot * 3,
        "std_itl_ms": 0.1,
        "p99_itl_ms": tpot * 6,
    }
    out.update(extra)
    return out


def write(folder, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


# ---- the table --------------------------------------------------------------------------------
def test_table_compares_each_dataset_and_concurrency(tmp_path):
    write(tmp_path, "specserve-random-c1.json", vllm_result(10.0, 1.0, 2000.0))
    write(tmp_path, "vllm-random-c1.json", vllm_result(20.0, 4.0, 500.0))
    write(tmp_path, "specserve-random-c16.json", vllm_result(30.0, 2.0, 8000.0))
    write(
        tmp_path,
        "vllm-random-c16.json",
        vllm_result(15.0, 2.5, 6400.0, spec_decode_acceptance_length=2.25),
    )
    write(tmp_path, "specserve-chat-c1.json", vllm_result(12.0, 1.5, 1800.0))
    write(tmp_path, "vllm-chat-c1.json", vllm_result(24.0, 3.0, 600.0))
    # specserve's counters around its random c16 run: 300 tokens in 100 verify steps
    before = {"spec_verify_steps": 50, "spec_accepted_tokens": 90, "engine_steps": 10}
    after = {"spec_verify_steps": 150, "spec_accepted_tokens": 390, "engine_steps": 40}
    after.update(prefill_batches=7, graph_captures=2)
    write(tmp_path, "specserve-random-c16.before.json", before)
    write(tmp_path, "specserve-random-c16.after.json", after)
    # what else lands in the folder: logs, vLLM's optional pytorch-format file
    write(tmp_path, "specserve-random-c1.pytorch.json", {"not": "a result"})
    (tmp_path / "specserve-random-c1.log").write_text("log")

    rows = comparison_rows(load_results(str(tmp_path)))
    by_key = {(r["dataset"], r["concurrency"]): r for r in rows}
    assert sorted(by_key) == [("chat", 1), ("random", 1), ("random", 16)]
    r1 = by_key[("random", 1)]
    assert r1["ratio_mean_ttft_ms"] == pytest.approx(0.5)
    assert r1["ratio_mean_tpot_ms"] == pytest.approx(0.25)
    assert r1["ratio_output_throughput"] == pytest.approx(4.0)
    r16 = by_key[("random", 16)]
    assert r16["specserve_spec_decode_acceptance_length"] == pytest.approx(3.0)
    assert r16["vllm_spec_decode_acceptance_length"] == pytest.approx(2.25)
    assert r16["ratio_output_throughput"] == pytest.approx(1.25)

    table = format_table(rows)
    assert (
        "random | 1 | 10 | 20 | 0.5 | 10 | 20 | 0.5 | 20 | 40 | 0.5 | 1 | 4 | 0.25 | 2000 | 500 | 4 | - | -"
        in table
    )
    assert (
        "random | 16 | 30 | 15 | 2 | 30 | 15 | 2 | 60 | 30 | 2 | 2 | 2.5 | 0.8 | 8000 | 6400 | 1.25 | 3 | 2.25"
        in table
    )
    assert "warning" not in table
    # the engine's counters over the run, those the server lacked as "-"
    assert "random | 16 | 30 | 7 | - | - | 2" in table.split("engine during each run")[1]


def test_table_shows_a_missing_side_and_flags_unfair_rows(tmp_path):
    write(tmp_path, "specserve-chat-c64.json", vllm_result(50.0, 5.0, 9000.0))
    write(tmp_path, "specserve-random-c64.json", vllm_result(50.0, 5.0, 9000.0, failed=3))
    write(
        tmp_path, "vllm-random-c64.json", vllm_result(60.0, 6.0, 7000.0, total_output_tokens=8000)
    )
    table = format_table(comparison_rows(load_results(str(tmp_path))))
    assert "chat | 64 | 50 | - | - |" in table
    assert "warning: specserve random at concurrency 64: 3 requests failed" in table
    assert "specserve generated 8192 tokens, vLLM 8000" in table


# ---- specserve's counters ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_server():
    engine = Engine(
        **TINY,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",  # the model as its own draft: all accepted
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    )
    app = create_app(engine, ServerConfig(), owns_engine=True)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        yield srv.url, http


def test_counters_give_the_accept_length_of_the_requests_between(spec_server):
    url, http = spec_server
    before = fetch_counters(url)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    deadline = time.monotonic() + 10
    while (after := fetch_counters(url))["spec_verify_steps"] == before["spec_verify_steps"]:
        assert time.monotonic() < deadline, "the counters never moved"
        time.sleep(0.05)
    assert after["spec_verify_steps"] - before["spec_verify_steps"] == usage["spec_verify_ct"]
    steps = engine_deltas(before, after)
    assert steps["prefill_batches"] == 1 and steps["engine_steps"] >= 2
    assert steps["decode_steps_launched_ahead"] >= 1  # (overlap is on)
    assert accept_length(before, after) == pytest.approx(usage["spec_accept_length"], abs=0.01)
    assert accept_length(before, after) > 2.0  # its own draft: nearly every token accepted


# ---- inputs for vLLM's client -----------------------------------------------------------------
def test_prompt_file_is_what_vllm_custom_dataset_reads(tmp_path):
    path = str(tmp_path / "prompts.jsonl")
    assert write_prompt_file(path) == 200
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert all(set(r) == {"prompt"} and r["prompt"].strip() for r in rows)
    assert [r["prompt"] for r in rows] == packaged_prompts()
    assert not any("<|im_start|>" in r["prompt"] for r in rows)  # the client templates
    with pytest.raises(ValueError, match="jsonl"):
        write_prompt_file(str(tmp_path / "prompts.json"))


@pytest.mark.slow
def test_tokenizer_folder_makes_the_servers_token_ids(tmp_path):
    """vLLM's client counts prompt tokens and, on /v1/completions, applies the chat template
    with this folder; both must agree with the ids specserve's chat route makes."""
    from transformers import AutoTokenizer

    from specserve.model.registry import resolve_packaged
    from specserve.model.tokenizer import apply_chat_template, load_tokenizer

    write_tokenizer_folder(str(tmp_path / "tok"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = load_tokenizer(resolve_packaged("smollm2-135m"), "gguf")
    for text in packaged_prompts()[::40]:
        messages = [{"role": "user", "content": text}]
        templated = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert theirs(templated).input_ids == apply_chat_template(ours, messages)
        assert theirs(text).input_ids == ours(text).input_ids
    assert theirs.eos_token == ours.eos_token == "<|im_end|>"

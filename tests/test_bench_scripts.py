"""The bench/ scripts and `specserve bench serving` as a user meets them on a CPU machine
without vLLM: help without side effects, one-line errors naming the option before anything
runs, one exit code for "needs a CUDA device", and valid JSON with an API key sent."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from specserve.bench import serving

ROOT = Path(__file__).resolve().parents[1]
NOT_HERE_EXIT = 3  # bench/script_checks.py


def run(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench" / script), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str, rc: int = 2) -> None:
    assert done.returncode == rc, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "error" in last and all(w in last for w in words), last


# ---- bench/adaptive_policy_trace.py -----------------------------------------------------------
def test_policy_trace_help_runs_nothing_and_writes_no_file(tmp_path):
    done = run("adaptive_policy_trace.py", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "OUT.json" in done.stdout
    assert list(tmp_path.iterdir()) == []  # (it wrote a file named --help)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--batch-size", "8", "out.json"], ["OUT.json", "first"]),
        (["/nope/trace.json", "--batch-size", "1"], ["OUT.json", "/nope"]),
    ],
)
def test_policy_trace_bad_output_path_is_refused_before_the_run(tmp_path, args, words):
    assert_one_line_error(run("adaptive_policy_trace.py", *args, cwd=tmp_path), *words)
    assert list(tmp_path.iterdir()) == []


# ---- bench/vllm_peer.py (no vLLM here) ---------------------------------------------------------
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed"
)
@pytest.mark.parametrize("cmd", ["one-batch", "multiturn"])
def test_vllm_peer_without_vllm_says_so_in_one_line(cmd):
    done = run("vllm_peer.py", cmd, "--preset", "tiny")
    assert_one_line_error(done, "needs vLLM installed", rc=NOT_HERE_EXIT)


@pytest.mark.parametrize(
    "args, words",
    [
        (["one-batch", "--preset", "nosuch"], ["--preset", "tiny"]),
        (["one-batch", "--batch-size", "0"], ["--batch-size", ">= 1"]),
        (["multiturn", "--turns", "0"], ["--turns", ">= 1"]),
        (["hf-folder", "--model", "/nope.gguf", "x"], ["--model", "/nope.gguf"]),
        (["eagle-draft", "/nope", "d"], ["src", "/nope"]),
    ],
)
def test_vllm_peer_bad_values_are_one_line_errors(tmp_path, args, words):
    assert_one_line_error(run("vllm_peer.py", *args, cwd=tmp_path), *words)
    assert list(tmp_path.iterdir()) == []  # (nothing written for the refused run)


# ---- engine scripts: values checked before (or as) the engine starts --------------------------
@pytest.mark.parametrize(
    "script, args, words",
    [
        ("host_profile.py", ["--output-json", "/nope/x.json"], ["--output-json", "/nope"]),
        ("host_profile.py", ["--batch-size", "0"], ["--batch-size"]),
        ("host_profile.py", ["--dtype", "int8"], ["--dtype", "bfloat16"]),
        ("host_profile.py", ["--model-path", "/nope"], ["--model-path", "/nope"]),
        ("penalized_decode.py", ["--batch-size", "0"], ["--batch-size"]),
        ("first_requests_by_sampling_mode.py", ["--batch-size", "0"], ["--batch-size"]),
        ("plot_throughput.py", ["/nope"], ["OUT_DIR", "/nope"]),
    ],
)
def test_engine_script_bad_values_are_one_line_errors(script, args, words):
    assert_one_line_error(run(script, *args), *words)


def test_host_profile_says_a_chat_prompt_needs_a_tokenizer():
    done = run("host_profile.py", "--model-path", "tiny", "--load-format", "dummy",
               "--device", "cpu", "--dtype", "float32")  # fmt: skip
    assert_one_line_error(done, "--model-path", "tokenizer")


# ---- GPU-only scripts -------------------------------------------------------------------------
GPU_ONLY = [
    "attention_kernels.py",
    "deterministic_cost.py",
    "host_primitive_costs.py",
    "host_speed_under_overlap.py",
    "l2_prefetch_decoder.py",
    "layer_stack.py",
    "linear_kernels.py",
    "sampler_draw.py",
    "tier_step_cost.py",
    "topk_kernels.py",
    "weight_stream_bandwidth.py",
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machines without CUDA")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_only_scripts_all_say_they_need_cuda_with_one_exit_code(script, tmp_path):
    done = run(script, cwd=tmp_path)
    assert_one_line_error(done, script, "needs a CUDA device", rc=NOT_HERE_EXIT)
    assert list(tmp_path.iterdir()) == []  # (deterministic_cost started CPU runs)


# ---- specserve bench serving ------------------------------------------------------------------
def serving_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serving.add_serving_parser(p.add_subparsers())
    return p.parse_args(["serving", *argv])


class _Server:
    """A stand-in OpenAI server that wants `Authorization: Bearer KEY` on every request."""

    KEY = "s3cret"

    def __enter__(self):
        key = self.KEY

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, body: bytes, kind="application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {key}":
                    return True
                self._reply(401, b'{"error": {"message": "invalid api key"}}')
                return False

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path == "/v1/models":
                    self._reply(200, b'{"data": [{"id": "m"}]}')
                else:
                    self._reply(404, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self._authorized():
                    return
                chunk = {"choices": [{"delta": {"content": "hi"}}]}
                usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
                body = "".join(f"data: {json.dumps(c)}\n\n" for c in (chunk, usage))
                self._reply(200, (body + "data: [DONE]\n\n").encode(), "text/event-stream")

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_serving_sends_the_api_key_and_writes_valid_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    out = tmp_path / "summary.json"
    with _Server() as srv:
        args = serving_args("--base-url", srv.url, "--api-key", srv.KEY, "--num-prompts", "2",
                            "--output-len", "1", "--quiet", "--output-json", str(out))  # fmt: skip
        assert serving.cmd_serving(args) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[: printed.index("\n}") + 2], parse_constant=_no_constants)
    assert summary["completed"] == 2
    assert summary["request_rate"] == "inf"  # as vLLM's result files write it
    saved = json.loads(out.read_text(), parse_constant=_no_constants)
    assert saved["summary"]["request_rate"] == "inf"


def test_serving_reads_the_key_from_openai_api_key_as_vllm_bench_does(monkeypatch, capsys):
    with _Server() as srv:
        monkeypatch.setenv("OPENAI_API_KEY", srv.KEY)
        args = serving_args("--base-url", srv.url, "--num-prompts", "1", "--output-len", "1",
                            "--quiet")  # fmt: skip
        assert serving.cmd_serving(args) == 0
    assert '"completed": 1' in capsys.readouterr().out


def _no_constants(name: str):
    raise ValueError(f"not JSON: {name}")


def test_serving_says_the_server_refused_the_key(capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with _Server() as srv:
        args = serving_args("--base-url", srv.url, "--api-key", "wrong", "--dataset", "random",
                            "--endpoint", "completions", "--quiet")  # fmt: skip
        assert serving.cmd_serving(args) == 1
    err = capsys.readouterr().err
    assert srv.url in err and "refused the API key" in err and "--vocab-size" not in err


def test_serving_says_the_server_could_not_be_reached(capsys):
    with _Server() as srv:
        url = srv.url  # (closed on exit: nothing listens there any more)
    args = serving_args("--base-url", url, "--dataset", "random", "--endpoint", "completions",
                        "--quiet")  # fmt: skip
    assert serving.cmd_serving(args) == 1
    err = capsys.readouterr().err
    assert f"could not reach the server at {url}" in err and "--vocab-size" not in err


def test_serving_names_the_flag_file_and_line_of_a_bad_dataset(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    assert serving.cmd_serving(serving_args("--dataset", str(bad), "--port", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --dataset {bad}, line 2:"), err


def test_serving_help_tells_defaults_and_never_a_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "do-not-print-me")
    p = argparse.ArgumentParser()
    help_text = serving.add_serving_parser(p.add_subparsers()).format_help()
    assert "do-not-print-me" not in help_text
    for option, default in [("--num-prompts", "100"), ("--output-len", "128"),
                            ("--port", "30000"), ("--request-rate", "inf")]:  # fmt: skip
        block = help_text[help_text.index("\n  " + option + " ") + 1 :].split("\n  --")[0]
        assert f"(default: {default})" in block, block


def test_serving_help_has_a_description_for_every_option():
    p = argparse.ArgumentParser()
    sub = serving.add_serving_parser(p.add_subparsers())
    bare = [a.option_strings for a in sub._actions if not a.help]
    assert bare == []

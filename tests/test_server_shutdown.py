"""`specserve serve` as a process: drain on the first signal (socket open, 503s, in-flight
requests finish), exit at once on the second (open requests end with an error), and a taken
port detected before the model loads."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.test_server import free_port

TINY_ARGS = ["--model-path", "tiny", "--load-format", "dummy", "--skip-tokenizer-init"]


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *TINY_ARGS]
    proc = subprocess.Popen(
        [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def long_stream(n: int) -> dict:
    return {"prompt": [3, 4, 5], "max_tokens": n, "ignore_eos": True, "stream": True}


def test_first_signal_drains_with_the_socket_open():
    proc, url = start_server("--graceful-shutdown-timeout", "30")
    try:
        events: list[str] = []
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long_stream(1500)) as resp:
                lines = resp.iter_lines()
                while len(events) < 3:
                    line = next(lines)
                    if line.startswith("data: "):
                        events.append(line[6:])
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                with httpx.Client(base_url=url, timeout=10) as other:
                    health = other.get("/health")
                    assert health.status_code == 503
                    assert health.json()["status"] == "shutting down"
                    r = other.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                    assert r.status_code == 503
                    assert "shutting down" in r.json()["error"]["message"]
                events += [line[6:] for line in lines if line.startswith("data: ")]
        rc = proc.wait(timeout=30)
        output = proc.stdout.read()
    finally:
        stop(proc)
    assert rc == 0, output
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert not any("error" in p for p in payloads)
    ids = [t for p in payloads for c in p["choices"] for t in c.get("token_ids") or []]
    assert len(ids) == 1500  # finished in full during the drain
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_second_signal_ends_open_requests_with_an_error_and_exits():
    proc, url = start_server("--graceful-shutdown-timeout", "60")
    try:
        plain: dict = {}

        def non_streaming():
            body = {**long_stream(2000), "stream": False}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            plain.update(status=r.status_code, ctype=r.headers["content-type"], body=r.text)

        t = threading.Thread(target=non_streaming)
        t.start()
        events: list[str] = []
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long_stream(2000)) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:
                        proc.send_signal(signal.SIGTERM)
                        time.sleep(0.3)
                        signalled = time.monotonic()
                        proc.send_signal(signal.SIGTERM)
        t.join(timeout=30)
        rc = proc.wait(timeout=30)
        exit_s = time.monotonic() - signalled
        output = proc.stdout.read()
    finally:
        stop(proc)
    assert rc == 0, output
    assert exit_s < 10, output
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert len(events) < 2000
    assert plain["status"] == 503 and plain["ctype"].startswith("application/json"), plain
    assert "shutting down" in json.loads(plain["body"])["error"]["message"]


def test_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *TINY_ARGS]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "port" in r.stderr and str(port) in r.stderr
    assert "loaded" not in r.stderr

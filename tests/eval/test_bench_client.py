"""vLLM's benchmark client against a server that, as llama-server b11434 does, answers a streamed
completion with ``Keep-Alive`` and then drops the connection instead of answering a next request
on it: without ``--new-connection-per-request`` every request after the first fails; with it,
every request is answered (eval/serve_bench/client.py's docstring). And the client as a child process:
bounded, ended with its whole tree, its failure reported with its log."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class DroppingServer:
    """One request per connection, streamed as llama-server streams it (``Keep-Alive: timeout=5``);
    a second request on the same connection is read and dropped unanswered."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answered = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _read_request(self, f) -> bool:  # noqa: ANN001 - a socket file
        """Reads one request; True when it was a completion (the client also reads /metrics)."""
        length = 0
        line = f.readline()
        if not line:
            return False
        completion = line.startswith(b"POST /v1/completions")
        while line not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            line = f.readline()
        f.read(length)
        return completion

    def _connection(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            if not self._read_request(f):
                return  # closed, or not a completion (answered by the close, as an unknown path)
            head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                b"Keep-Alive: timeout=5, max=100\r\n\r\n"
            )
            body = b"".join(
                _chunk(b"data: " + json.dumps({"choices": [{"text": t, "index": 0}]}).encode() + b"\n\n")
                for t in ("a", "b", "c")
            )
            usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 4}}
            body += _chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + _chunk(b"data: [DONE]\n\n")
            conn.sendall(head + body + b"0\r\n\r\n")
            self.answered += 1
            self._read_request(f)  # the client's next request on this connection: never answered

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("new_connection", [False, True], ids=["reused", "new-per-request"])
def test_a_server_that_drops_kept_alive_connections_fails_requests_unless_each_has_its_own(
    new_connection, tmp_path, tiny_target_and_shards
):
    from eval.serve_bench.client import NEW_CONNECTION_PER_REQUEST

    target, _ = tiny_target_and_shards
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": f"hello {i}", "output_tokens": 3}) + "\n" for i in range(4)))
    server = DroppingServer()
    out = tmp_path / "result.json"
    argv = [sys.executable, "-m", "eval.serve_bench.client", str(out)]
    argv += [NEW_CONNECTION_PER_REQUEST] if new_connection else []
    argv += ["--backend", "vllm", "--base-url", server.url, "--model", str(target), "--dataset-name", "custom"]
    argv += ["--dataset-path", str(traffic), "--num-prompts", "4", "--custom-output-len", "-1"]
    argv += ["--max-concurrency", "1", "--request-rate", "inf", "--num-warmups", "0", "--disable-shuffle"]
    argv += ["--skip-chat-template", "--disable-tqdm", "--save-detailed"]
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    if new_connection:
        assert (result["completed"], result["failed"], server.answered) == (4, 0, 4)
        assert result["total_output_tokens"] == 12 and result["first_errors"] == []
    else:
        assert result["completed"] < 4 and result["failed"] > 0 and "Disconnected" in result["first_errors"][0]


# --- the client as a child process ----------------------------------------------------------------


def _fake_client(tmp_path: Path, body: str) -> str:
    """An executable that run_client starts in place of ``python -m eval.serve_bench.client ...``."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return str(fake)


def test_a_client_past_its_bound_is_ended_with_the_processes_it_started(tmp_path, monkeypatch):
    """Issue #50: the client runs as every child does (dspark.core.waits.run_child): past
    serve_bench.level_timeout_s it and its own children are killed, and the error is as before."""
    import psutil

    from eval.serve_bench.client import run_client

    pidfile = tmp_path / "child.pid"
    monkeypatch.setattr(sys, "executable", _fake_client(tmp_path, f"sleep 600 &\necho $! > {pidfile}\nsleep 600\n"))
    out = tmp_path / "level.json"
    with pytest.raises(RuntimeError) as e:
        run_client([], out, timeout_s=2, what="serve_bench ours (dspark), concurrency 1")
    assert str(e.value) == (
        "serve_bench ours (dspark), concurrency 1: vLLM's benchmark client ran past 2s "
        f"(serve_bench.level_timeout_s); its log: {tmp_path / 'level.log'}"
    )
    child = int(pidfile.read_text())
    try:
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
    except psutil.NoSuchProcess:
        pass


def test_a_client_that_fails_is_reported_with_its_status_and_log(tmp_path, monkeypatch):
    from eval.serve_bench.client import run_client

    monkeypatch.setattr(sys, "executable", _fake_client(tmp_path, "echo 'ValueError: no such model'\nexit 3\n"))
    out = tmp_path / "level.json"
    with pytest.raises(RuntimeError) as e:
        run_client([], out, timeout_s=60, what="serve_bench none, concurrency 1")
    log = tmp_path / "level.log"
    assert str(e.value).startswith(
        f"serve_bench none, concurrency 1: vLLM's benchmark client failed (exit 3); its log: {log}\n"
    )
    assert "ValueError: no such model" in str(e.value) and "ValueError: no such model" in log.read_text()

"""The serving benchmark's own pieces without vLLM: the traffic file check, the port choice, the
server life cycle (a fake server that never becomes healthy, one that exits, one that answers),
the JSON, table and plots from vLLM-shaped results. The real servers: test_serve_bench_vllm.py."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dspark.export.stage import ExportRecordError
from eval.serve_bench.client import METRICS, client_argv, level_record
from eval.serve_bench.configs import (
    TrafficFileError,
    load_traffic,
    resolve_configs,
    serves_exports,
)
from eval.serve_bench.report import TABLE_COLUMNS, assemble, table_rows, wandb_scalars, write_outputs
from eval.serve_bench.server import (
    Configuration,
    PortInUseError,
    Server,
    ServerStartError,
    choose_port,
    engine_flags,
    port_in_use,
    running_server,
    server_command,
)
from eval.serve_bench.stage import (
    BenchSetup,
    server_max_model_len,
)

REPO = Path(__file__).resolve().parents[2]


# --- traffic files -----------------------------------------------------------------------------


def test_a_good_traffic_file_loads(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt": "there", "output_tokens": 5, "extra": 1}\n')
    assert load_traffic(path) == [{"prompt": "hi"}, {"prompt": "there", "output_tokens": 5, "extra": 1}]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', "{path}:2: not valid JSON ("),
        ('{"prompt": "a"}\n["b"]\n', '{path}:2: expected a JSON object with a "prompt" string, got'),
        ('{"prompt": "a"}\n\n{"text": "b"}\n', '{path}:3: field "prompt" is None, expected a non-empty string'),
        ('{"prompt": "  "}\n', "{path}:1: field \"prompt\" is '  ', expected a non-empty string"),
        ('{"prompt": "a", "output_tokens": 0}\n', '{path}:1: field "output_tokens" is 0, expected an integer >= 1'),
        ('{"prompt": "a", "output_tokens": "9"}\n', "{path}:1: field \"output_tokens\" is '9', expected an integer"),
        ("\n\n", "serve_bench.traffic_file={path}: no requests in it"),
    ],
)
def test_a_bad_traffic_file_is_refused_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "traffic.jsonl"
    path.write_text(text)
    with pytest.raises(TrafficFileError) as e:
        load_traffic(path)
    assert str(e.value).startswith(message.format(path=path)), str(e.value)


def test_a_missing_or_non_jsonl_traffic_file_is_refused(tmp_path):
    with pytest.raises(TrafficFileError, match=r"traffic_file=.*nope.jsonl: no such file"):
        load_traffic(tmp_path / "nope.jsonl")
    csv = tmp_path / "t.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(TrafficFileError, match=r"t.csv: expected a .jsonl file"):
        load_traffic(csv)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(TrafficFileError, match="not UTF-8"):
        load_traffic(binary)


# --- ports ---------------------------------------------------------------------------------------


def test_port_zero_picks_a_free_port_and_a_taken_port_is_refused():
    port = choose_port("127.0.0.1", 0)
    assert 0 < port < 65536 and not port_in_use("127.0.0.1", port)
    assert choose_port("127.0.0.1", port) == port  # free: used as given
    with socket.socket() as s:  # a listener: never reused
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(PortInUseError) as e:
            choose_port("127.0.0.1", taken)
        assert str(e.value) == (
            f"serve_bench.port={taken}: 127.0.0.1:{taken} is in use (another server?); it is not reused, expected a "
            "free port, or serve_bench.port=0 to pick one"
        )
    with socket.socket() as s:  # bound, not listening yet: also taken
        s.bind(("127.0.0.1", 0))
        assert port_in_use("127.0.0.1", s.getsockname()[1])


# --- server life cycle ----------------------------------------------------------------------------

NEVER_HEALTHY = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker, as vLLM's engine core
print("loading...", flush=True)
time.sleep(600)
"""

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_a_server_never_healthy_is_stopped_and_its_log_named(tmp_path):
    log = tmp_path / "logs" / "server_ours.log"
    seen: list[psutil.Process] = []
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as e:
        with running_server(
            [sys.executable, "-c", NEVER_HEALTHY],
            host="127.0.0.1",
            port=choose_port("127.0.0.1", 0),
            log_path=log,
            timeout_s=3,
            env={"PATH": "/usr/bin:/bin"},
            what="serve_bench ours (dflash)",
        ):
            pass  # not reached
    assert time.monotonic() - t0 < 60
    assert str(e.value) == (
        "serve_bench ours (dflash): the vLLM server was not healthy within 3s (serve_bench.start_timeout_s) and "
        f"was stopped; its log: {log}"
    )
    assert "loading..." in log.read_text()
    # nothing of it is left: the server and the worker it started
    left = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])]
    assert not left, left
    del seen


def test_a_server_that_exits_is_reported_with_its_status_and_log(tmp_path):
    log = tmp_path / "server_none.log"
    with pytest.raises(ServerStartError) as e:
        with running_server(
            [sys.executable, "-c", "import sys; print('ValueError: no such model'); sys.exit(3)"],
            host="127.0.0.1",
            port=choose_port("127.0.0.1", 0),
            log_path=log,
            timeout_s=60,
            env={"PATH": "/usr/bin:/bin"},
            what="serve_bench none",
        ):
            pass
    msg = str(e.value)
    assert msg.startswith(
        f"serve_bench none: the vLLM server exited with status 3 before it was healthy; its log: {log}"
    )
    assert "ValueError: no such model" in msg


def test_a_healthy_server_is_yielded_then_stopped(tmp_path):
    port = choose_port("127.0.0.1", 0)
    with running_server(
        [sys.executable, "-c", HEALTHY, str(port)],
        host="127.0.0.1",
        port=port,
        log_path=tmp_path / "s.log",
        timeout_s=60,
        env={"PATH": "/usr/bin:/bin"},
        what="fake",
    ) as server:
        assert server.url == f"http://127.0.0.1:{port}" and port_in_use("127.0.0.1", port)
        pid = server.proc.pid
    assert server.pids == [pid] and not psutil.pid_exists(pid) and server.proc.returncode is not None
    assert not port_in_use("127.0.0.1", port)


def test_the_server_command_carries_the_evals_engine_arguments(tmp_path):
    c = Configuration("ours", "dflash", tmp_path / "export")
    cmd = server_command(
        tmp_path / "target",
        c,
        host="127.0.0.1",
        port=8011,
        gamma=4,
        max_model_len=600,
        dtype="float32",
        seed=0,
        engine_kwargs={"tensor_parallel_size": 16, "trust_remote_code": True, "nnodes": 4, "master_addr": "h0"},
    )
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    i = cmd.index("--speculative-config")
    assert json.loads(cmd[i + 1]) == {
        "method": "dflash",
        "model": str(tmp_path / "export"),
        "num_speculative_tokens": 4,
    }
    assert cmd[cmd.index("--port") + 1] == "8011" and "--enforce-eager" in cmd
    assert "--no-enable-prefix-caching" in cmd  # each level pays its own prefill
    assert cmd[-7:] == ["--tensor-parallel-size", "16", "--trust-remote-code", "--nnodes", "4", "--master-addr", "h0"]
    plain = dict(host="h", port=1, gamma=4, max_model_len=9, dtype="bfloat16", seed=0, engine_kwargs={})
    assert "--speculative-config" not in server_command(tmp_path, Configuration("none"), **plain)
    cached = server_command(tmp_path, Configuration("none"), **plain, prefix_caching=True)
    assert "--no-enable-prefix-caching" not in cached
    assert engine_flags({"a_b": False, "c": None, "d": {"x": 1}}) == ["--d", '{"x": 1}']


# --- JSON, table, plots ----------------------------------------------------------------------------


def vllm_result(tps: float, *, drafts: int = 0, accepted: int = 0, gamma: int = 4, tokens: int = 48) -> dict:
    """The keys vLLM's benchmark returns (vllm.benchmarks.serve), with made-up values."""
    r = {theirs: 10.0 + i for i, theirs in enumerate(METRICS.values())}
    r.update(output_throughput=tps, completed=4, failed=0, total_output_tokens=tokens)
    if drafts:
        r.update(
            spec_decode_num_drafts=drafts,
            spec_decode_draft_tokens=drafts * gamma,
            spec_decode_accepted_tokens=accepted,
            spec_decode_acceptance_rate=100 * accepted / (drafts * gamma),
            spec_decode_acceptance_length=1 + accepted / drafts,
            spec_decode_per_position_acceptance_rates=[0.5, 0.25, 0.1, 0.0],
        )
    return r


def test_the_json_has_every_metric_the_counters_and_the_speedup(tmp_path):
    mem = {"peak_rss_gib": 1.5, "peak_gpu_gib": None}
    configs = []
    for c, tps, drafts, accepted in (
        (Configuration("none"), (20.0, 30.0), 0, 0),
        (Configuration("ngram", "ngram"), (25.0, 33.0), 20, 17),
        (Configuration("ours", "dflash", Path("/x")), (30.0, 36.0), 10, 0),
    ):
        levels = [
            level_record(vllm_result(t, drafts=drafts, accepted=accepted), c, 4, conc, mem, tmp_path / "c.log")
            for conc, t in zip((1, 2), tps)
        ]
        configs.append(
            {
                "name": c.name,
                "label": c.label,
                "method": c.method,
                "server_log": "s.log",
                "server_start_s": 9.0,
                "levels": [lv.__dict__ for lv in levels],
                "memory": mem,
            }
        )
    data = assemble(
        {
            "target": "t",
            "target_path": "/t",
            "device": "cpu",
            "dtype": "float32",
            "gamma": 4,
            "num_requests": 4,
            "traffic_kind": "eval set",
            "traffic": "e.jsonl",
            "output_len": 12,
            "ignore_eos": True,
            "temperature": 0.0,
            "request_rate": None,
            "concurrency": [1, 2],
        },
        list(reversed(configs)),
    )
    assert [c["name"] for c in data["configs"]] == ["none", "ngram", "ours"]  # the report's order
    assert data["speedup_over_none"] == {"ngram": {"1": 1.25, "2": 1.1}, "ours": {"1": 1.5, "2": 1.2}}
    ngram = data["configs"][1]["levels"][0]["spec"]
    assert ngram["tau"] == pytest.approx(1 + 17 / 20) and ngram["num_accepted"] <= ngram["num_drafts"] * 4
    assert ngram["accepted_per_pos"] == [10, 5, 2, 0] and ngram["acceptance_rate"] == pytest.approx(17 / 80)
    # every verification step: 48 output tokens of 4 requests, 4 from prefill, 17 accepted -> 27 steps
    assert ngram["num_steps"] == 48 - 4 - 17 == 27
    assert ngram["tokens_per_step"] == pytest.approx(1 + 17 / 27) == pytest.approx(1.6296, abs=1e-4)
    assert ngram["draft_share"] == pytest.approx(20 / 27)
    ours = data["configs"][2]["levels"][0]["spec"]  # 10 drafts, nothing accepted: 44 steps of 1 token
    assert ours["num_steps"] == 44 and ours["tokens_per_step"] == 1.0 and ours["tau"] == 1.0
    assert ours["draft_share"] == pytest.approx(10 / 44)
    assert data["configs"][0]["levels"][0]["spec"] is None
    for cf in data["configs"]:
        for lv in cf["levels"]:
            assert set(lv["metrics"]) == set(METRICS)
            assert all(math.isfinite(v) for v in lv["metrics"].values())
    out = write_outputs(None, data, tmp_path)
    back = json.loads(out.json_path.read_text())
    assert back == json.loads(json.dumps(data))
    assert set(out.plots) == {"tokens_per_s", "itl_p95", "speedup"} and all(
        p.stat().st_size > 1000 for p in out.plots.values()
    )
    md = out.markdown.read_text()
    assert "| ours (dflash) | 2 | 36.0 |" in md and "| 1.20x |" in md and "![speedup](speedup.png)" in md
    assert "| E2E p50/p95 ms | tok/step | tau (drafted steps) | drafted | accept pos 1 |" in md
    rows = [line for line in md.splitlines() if line.startswith("| ngram | 1 |")]
    assert len(rows) == 1 and rows[0].split(" | ")[8:12] == ["1.630", "1.850", "74%", "0.500"], rows
    rows = [line for line in md.splitlines() if line.startswith("| ours (dflash) | 1 |")]
    assert rows[0].split(" | ")[8:11] == ["1.000", "1.000", "23%"], rows
    rows = [line for line in md.splitlines() if line.startswith("| none | 1 |")]
    assert rows[0].split(" | ")[8:12] == ["-", "-", "-", "-"], rows
    assert all(line.count("|") == 15 for line in md.splitlines() if line.startswith("| ")), md
    assert "tok/step: 1 + accepted / all verification steps" in md and "vLLM's counter" in md
    assert out.summary_line() == (
        "tokens/s at concurrency 1/2: none 20/30, ngram 25/33 (tok/step 1.63, tau 1.85), "
        "ours (dflash) 30/36 (tok/step 1.00, tau 1.00)"
    )
    scalars = wandb_scalars(data)
    assert scalars["serve_bench/ngram/c1/tokens_per_step"] == pytest.approx(1 + 17 / 27)
    assert scalars["serve_bench/ngram/c1/tau"] == pytest.approx(1.85)
    assert scalars["serve_bench/ngram/c1/draft_share"] == pytest.approx(20 / 27)
    assert not {f"serve_bench/none/c1/{k}" for k in ("tokens_per_step", "tau", "draft_share")} & set(scalars)
    table = table_rows(data)
    assert len(table) == 6 and all(len(r) == len(TABLE_COLUMNS) for r in table)
    ngram_row = dict(zip(TABLE_COLUMNS, table[2]))
    assert ngram_row["config"] == "ngram" and ngram_row["concurrency"] == 1
    assert ngram_row["tokens_per_step"] == pytest.approx(1 + 17 / 27) and ngram_row["tau"] == pytest.approx(1.85)
    assert ngram_row["draft_share"] == pytest.approx(20 / 27) and ngram_row["output_tokens_per_s"] == 25.0
    assert dict(zip(TABLE_COLUMNS, table[0]))["tokens_per_step"] is None  # no speculation: no spec


def test_llama_cpp_rows_count_from_its_counters_and_their_speedup_is_over_llama_cpp_none(tmp_path):
    """llama-server's /metrics counters go through the same counting as vLLM's, and each engine's
    rows are compared with no speculation on the same engine."""
    from dspark.serving.llama_cpp.server import Counters
    from eval.serve_bench.stage import llama_cpp_level_fields

    mem = {"peak_rss_gib": 1.0, "peak_gpu_gib": None}
    d = Counters(drafts=10, draft_tokens=40, accepted=12, predicted=48, accepted_per_pos=[6, 4, 2, 0])
    rows = []
    for c, tps, extra in (
        (Configuration("none"), 20.0, None),
        (Configuration("llama.cpp-none", engine="llama.cpp"), 10.0, Counters(predicted=48)),
        (Configuration("llama.cpp-dspark", "dspark", Path("/d.gguf"), engine="llama.cpp"), 5.0, d),
    ):
        raw = vllm_result(tps)
        if extra:
            raw.update(llama_cpp_level_fields(extra, raw, c.method is not None))
        lv = level_record(raw, c, 4, 1, mem, tmp_path / "c.log")
        rows.append({"name": c.name, "label": c.label, "method": c.method, "levels": [lv.__dict__], "memory": mem})
    data = assemble({}, list(reversed(rows)))
    assert [c["name"] for c in data["configs"]] == ["none", "llama.cpp-none", "llama.cpp-dspark"]
    assert data["speedup_over_none"] == {"llama.cpp-dspark": {"1": 0.5}}  # over llama.cpp-none, not vLLM's none
    spec = data["configs"][2]["levels"][0]["spec"]
    # 48 output tokens of 4 requests: 4 from prefill, 12 accepted -> 32 steps, 10 of them drafted
    assert spec["num_steps"] == 32 and spec["tokens_per_step"] == pytest.approx(1 + 12 / 32)
    assert spec["tau"] == pytest.approx(1 + 12 / 10) and spec["accepted_per_pos"] == [6, 4, 2, 0]
    assert spec["draft_share"] == pytest.approx(10 / 32)
    assert data["configs"][1]["levels"][0]["spec"] is None


def test_llama_cpp_levels_count_the_servers_tokens_not_the_clients_retokenized_text(tmp_path):
    """vLLM's client re-tokenizes llama-server's text (it misses the usage beside the last chunk's
    choices) and undercounts: steps, throughput and TPOT come from the server's own token count."""
    from dspark.serving.llama_cpp.server import Counters
    from eval.serve_bench.stage import llama_cpp_level_fields

    mem = {"peak_rss_gib": 1.0, "peak_gpu_gib": None}
    # the client saw 44 tokens of the 48 generated; 12 accepted in 10 drafts over 4 requests
    raw = vllm_result(22.0, tokens=44)
    raw.update(duration=2.0, total_input_tokens=100, mean_tpot_ms=40.0, p50_tpot_ms=30.0)
    d = Counters(drafts=10, draft_tokens=40, accepted=12, predicted=48, decodes=36, accepted_per_pos=[6, 4, 2, 0])
    raw.update(llama_cpp_level_fields(d, raw, True))
    assert raw["client_output_tokens"] == 44 and raw["total_output_tokens"] == 48
    assert raw["output_throughput"] == pytest.approx(24.0)  # 22 x 48/44
    assert raw["total_token_throughput"] == pytest.approx((100 + 48) / 2.0)
    assert raw["mean_tpot_ms"] == pytest.approx(40.0 * 40 / 44) and raw["p50_tpot_ms"] == pytest.approx(30.0 * 40 / 44)
    lv = level_record(
        raw, Configuration("llama.cpp-dspark", "dspark", Path("/d"), engine="llama.cpp"), 4, 1, mem, tmp_path / "c.log"
    )
    # with the client's 44, steps would be 44 - 4 - 12 = 28; the server's 48 gives 32
    assert lv.spec["num_steps"] == 32 and lv.spec["draft_share"] == pytest.approx(10 / 32)
    assert lv.metrics["output_tokens_per_s"] == pytest.approx(24.0) and lv.metrics["total_output_tokens"] == 48
    # counters that cannot both hold (more drafts than steps, past a stop's cut) are an error
    raw = vllm_result(22.0, tokens=44)
    with pytest.raises(RuntimeError, match="17 drafts in 12 verification steps"):
        llama_cpp_level_fields(Counters(drafts=17, draft_tokens=60, accepted=12, predicted=28), raw, True)


def test_steps_come_from_the_output_tokens_and_are_unknown_without_them(tmp_path):
    mem = {"peak_rss_gib": 1.0, "peak_gpu_gib": None}
    ngram = Configuration("ngram", "ngram")
    # 4 requests, 400 output tokens, 60 drafts with 90 accepted: 400 - 4 - 90 = 306 steps, 246 undrafted
    lv = level_record(vllm_result(50.0, drafts=60, accepted=90, tokens=400), ngram, 4, 1, mem, tmp_path / "c.log")
    assert lv.spec["num_steps"] == 306 and lv.spec["num_drafts"] == 60
    assert lv.spec["tokens_per_step"] == pytest.approx(1 + 90 / 306) == pytest.approx(1.2941, abs=1e-4)
    assert lv.spec["tau"] == pytest.approx(2.5) and lv.spec["draft_share"] == pytest.approx(60 / 306)
    # ngram never matched: every step a plain one, one token each
    lv = level_record(vllm_result(50.0, tokens=400), ngram, 4, 1, mem, tmp_path / "c.log")
    assert lv.spec["num_steps"] == 396 and lv.spec["num_drafts"] == 0
    assert lv.spec["tokens_per_step"] == 1.0 and lv.spec["draft_share"] == 0.0 and lv.spec["tau"] == 1.0
    # an older client result without the output counts: steps unknown, tokens per step NaN
    raw = vllm_result(50.0, drafts=60, accepted=90, tokens=400)
    del raw["total_output_tokens"], raw["completed"]
    lv = level_record(raw, ngram, 4, 1, mem, tmp_path / "c.log")
    assert lv.spec["num_steps"] == 0 and math.isnan(lv.spec["tokens_per_step"]) and math.isnan(lv.spec["draft_share"])
    assert lv.spec["tau"] == pytest.approx(2.5)
    del raw["spec_decode_num_drafts"], raw["spec_decode_accepted_tokens"]
    lv = level_record(raw, ngram, 4, 1, mem, tmp_path / "c.log")
    assert lv.spec["num_steps"] == 0 and math.isnan(lv.spec["tokens_per_step"]) and lv.spec["draft_share"] == 0.0


def test_serve_bench_is_not_a_default_stage_and_its_keys_are_checked(compose_config):
    from dspark.config import ConfigError

    cfg = compose_config("+experiment=smollm2_cpu_demo")
    assert "serve_bench" not in cfg.stages and cfg.serve_bench.concurrency == [1, 2, 4]
    assert cfg.serve_bench.output_len == cfg.eval.max_new_tokens
    assert compose_config("+experiment=kimi_k3_gb300").serve_bench.concurrency[-1] == 64
    for override, message in (
        ("serve_bench.configs=[eagle]", "serve_bench.configs[]='eagle': expected one of"),
        ("serve_bench.concurrency=[0]", "serve_bench.concurrency=[0]: expected a non-empty list of levels >= 1"),
        ("serve_bench.port=70000", "serve_bench.port=70000: expected 0 (pick a free one) or a TCP port"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            compose_config("+experiment=smollm2_cpu_demo", override)


def test_the_command_help_says_what_it_runs():
    out = subprocess.run(
        [sys.executable, "-m", "eval.serve_bench", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python -m eval.serve_bench: Serving A/B benchmark")
    assert "serve_bench.traffic_file=" in out.stdout and "vllm.entrypoints.openai.api_server" in out.stdout


def test_configurations_resolve_and_a_missing_drafter_is_named(compose_config, tmp_path):
    base = ("+experiment=smollm2_cpu_smoke", f"paths.output_dir={tmp_path}")
    cfg = compose_config(*base, "serve_bench.configs=[none,ngram]")
    assert resolve_configs(cfg, tmp_path, gpu=False) == [Configuration("none"), Configuration("ngram", "ngram")]
    assert not serves_exports(cfg)  # the export stage is not brought in: nothing of ours is served
    cfg = compose_config(*base, "serve_bench.configs=[none,dflash]")
    assert serves_exports(cfg)
    with pytest.raises(
        ExportRecordError, match=r"exports\.json: no export record \(nothing exported there yet\); run the export stage"
    ):
        resolve_configs(cfg, tmp_path, gpu=False)
    for configs, served in (("[ours]", True), ("[llama.cpp-dspark]", True), ("[llama.cpp-none,ngram]", False)):
        assert serves_exports(compose_config(*base, f"serve_bench.configs={configs}")) is served, configs


def test_output_len_null_takes_each_requests_own_length(tmp_path, compose_config):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "output_tokens": 300}\n{"prompt": "b"}\n')
    with pytest.raises(TrafficFileError) as e:
        load_traffic(path, need_output_tokens=True)
    assert str(e.value) == f'{path}:2: no "output_tokens", expected one on every line with serve_bench.output_len=null'
    cfg = compose_config("+experiment=smollm2_cpu_smoke", "serve_bench.output_len=null")
    server = Server(None, "127.0.0.1", 1, tmp_path / "s.log")
    argv = client_argv(
        server, target=tmp_path, traffic=path, templated=False, concurrency=2, num_prompts=2, sb=cfg.serve_bench, seed=0
    )
    assert argv[argv.index("--custom-output-len") + 1] == "-1" and "--skip-chat-template" not in argv
    assert server_max_model_len(cfg, 0, 300) == 512 + 300 + 4 + 1  # the largest bin + the longest answer + a block
    assert server_max_model_len(compose_config("+experiment=smollm2_cpu_smoke"), 600) == 600 + 12 + 4 + 1


def test_the_configurations_of_one_multi_node_job_share_their_conditions(tmp_path, compose_config):
    cfg = compose_config("+experiment=smollm2_cpu_smoke")
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"prompt": "a"}\n')

    def conditions(port: int) -> dict:
        kw = {"tensor_parallel_size": 16, "nnodes": 4, "node_rank": 0, "master_addr": "h0", "master_port": port}
        return BenchSetup(tmp_path, traffic, False, 1, 600, 4, "bfloat16", 0, kw, 1, True).conditions(cfg)

    assert conditions(29743) == conditions(29744)  # one srun step (and rendezvous port) per configuration
    assert conditions(29743)["engine_kwargs"] == {"tensor_parallel_size": 16, "nnodes": 4}


DRIVER = """
import sys, time
from pathlib import Path
from eval.serve_bench.server import running_server
port, log = int(sys.argv[1]), Path(sys.argv[2])
cmd = [sys.executable, "-c", sys.argv[3], str(port)]
with running_server(cmd, host="127.0.0.1", port=port, log_path=log, timeout_s=60, env={"PATH": "/usr/bin:/bin"},
                    what="fake") as server:
    print(server.proc.pid, flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_driver_takes_its_server_with_it(tmp_path):
    """kill -9 of the benchmark (no ``finally`` runs) must not leave a server holding the node."""
    port = choose_port("127.0.0.1", 0)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(port), str(tmp_path / "s.log"), HEALTHY],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server_pid = int(driver.stdout.readline())
        assert psutil.pid_exists(server_pid) and port_in_use("127.0.0.1", port)
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(server_pid):
            assert time.monotonic() < deadline, "the server outlived its killed driver"
            time.sleep(0.2)
        assert not port_in_use("127.0.0.1", port)
    finally:
        driver.kill()

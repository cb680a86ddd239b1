"""llama.cpp as the CPU serving engine (issue #36): its counters and logs read as llama-server b11434
writes them, its command line per method, what it refuses; then, with the build scripts/setup.sh
makes, the real converter and server on the tiny target and a 2-step drafter: the export's GGUF
drafts beside the target, a drafter of another target is refused, every method gives the target's
own greedy tokens and llama.cpp's dspark accepts what the reference loop accepts, a broken build
names its log, and nothing is left running."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from dspark.config import DSparkConfig
from dspark.export.gguf import llama_cpp_problem
from dspark.serving.llama_cpp.server import (
    Counters,
    ServerSpec,
    prompt_chunks,
    proposer_stats,
    read_counters,
    speculation_problem,
    steps_problem,
)
from dspark.serving.methods import LLAMA_CPP_BY_NAME, LLAMA_CPP_METHODS

REPO = Path(__file__).resolve().parents[2]

# /metrics of llama-server b11434 after one 16-token answer with a 4-token DSpark block
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
llamacpp:tokens_predicted_total 16
llamacpp:n_decode_total 9
llamacpp:n_tokens_max 27
llamacpp:spec_decode_num_draft_tokens_total 26
llamacpp:spec_decode_num_accepted_tokens_total 7
llamacpp:spec_decode_num_drafts_total 7
llamacpp:requests_processing 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 0
"""

STATS_LOG = """0.00.680.606 I spec common_specu: adding speculative implementation 'ngram-simple'
0.00.680.658 I common_speculative_impl_draft_dflash: adding speculative implementation 'draft-dspark'
0.05.184.416 I spec common_specu: statistics     ngram-simple: #calls(b,g,a) =    1      7      0, #gen drafts =      0, #acc drafts =     0, #gen tokens =      0, #acc tokens =     0, dur(b,g,a) = 0.001, 0.009, 0.000 ms
0.05.184.438 I spec common_specu: statistics     draft-dspark: #calls(b,g,a) =    1      7      7, #gen drafts =      7, #acc drafts =     7, #gen tokens =     26, #acc tokens =     7, #mean acc len = 2.00, #acc rate/pos = (1.000), dur(b,g,a) = 0.000, 103.894, 0.012 ms
0.05.302.260 I spec common_specu: statistics     draft-dspark: #calls(b,g,a) =    2     14     14, #gen drafts =     14, #acc drafts =    14, #gen tokens =     52, #acc tokens =    14, #mean acc len = 2.00, #acc rate/pos = (1.000), dur(b,g,a) = 0.001, 156.463, 0.018 ms
"""  # noqa: E501


class _Metrics:
    """A stand-in server whose /metrics is a fixed text (read_counters takes a Server's url)."""

    def __init__(self, text: str):
        import http.server
        import threading

        body = text.encode()

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_the_counters_are_read_from_llama_servers_metrics():
    m = _Metrics(METRICS)
    try:
        c = read_counters(m)
    finally:
        m.httpd.shutdown()
    assert (c.drafts, c.draft_tokens, c.accepted, c.decodes, c.predicted) == (7, 26, 7, 9, 16)
    assert c.accepted_per_pos == [7, 0, 0, 0]  # by position label, not by line order
    d = c.minus(Counters(drafts=2, draft_tokens=8, accepted=1, decodes=3, predicted=4, accepted_per_pos=[1, 0]))
    assert (d.drafts, d.draft_tokens, d.accepted, d.decodes, d.predicted) == (5, 18, 6, 6, 12)
    assert d.accepted_per_pos == [6, 0, 0, 0]
    assert c.processing == 0 and Counters(processing=1).minus(c).processing == 1  # a gauge: the later reading


def test_counters_are_read_once_no_request_is_in_flight():
    """A request's figures fold in as its slot is released: counters_after waits for the gauge to
    fall to 0 even when the tokens it was told to expect already show (the count may be low)."""
    from dspark.serving.llama_cpp.server import counters_after

    busy = _Metrics(METRICS.replace("requests_processing 0", "requests_processing 1"))
    idle = _Metrics(METRICS)
    try:
        t0 = time.monotonic()
        d = counters_after(busy, Counters(), 10, wait_s=0.5)
        assert time.monotonic() - t0 >= 0.5 and d.processing == 1  # gave up at the deadline
        t0 = time.monotonic()
        d = counters_after(idle, Counters(), 10, wait_s=5)
        assert time.monotonic() - t0 < 2 and d.predicted == 16 and d.processing == 0
    finally:
        busy.httpd.shutdown()
        idle.httpd.shutdown()


def test_steps_are_decodes_after_the_prompt_checked_against_the_output():
    # that answer: 12-token prompt = 1 chunk, 9 decodes -> 8 steps = 16 generated - 1 - 7 accepted
    assert prompt_chunks(12) == 1 and prompt_chunks(2048) == 1 and prompt_chunks(2049) == 2
    assert steps_problem(9 - prompt_chunks(12), 16, 7, gamma=4) is None
    assert steps_problem(11, 16, 7, gamma=4) is None  # a stop may cut up to gamma accepted tokens
    problem = steps_problem(13, 16, 7, gamma=4)
    assert problem is not None and "8 to 12" in problem and "n_decode_total" in problem
    assert steps_problem(7, 16, 7, gamma=4) is not None


def test_each_proposers_cumulative_draft_time_is_read_from_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(STATS_LOG)
    stats = proposer_stats(log)
    assert set(stats) == {"ngram-simple", "draft-dspark"}
    d = stats["draft-dspark"]  # the last line of each proposer: cumulative
    assert (d.drafts, d.draft_tokens, d.accepted_tokens, d.draft_ms) == (14, 52, 14, 156.463)
    assert stats["ngram-simple"].drafts == 0 and stats["ngram-simple"].draft_ms == 0.009


def test_a_proposer_llama_cpp_did_not_add_is_reported(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(STATS_LOG)
    assert speculation_problem(log, LLAMA_CPP_BY_NAME["ngram-then-dspark"]) is None
    assert speculation_problem(log, LLAMA_CPP_BY_NAME["none"]) is None
    log.write_text("0.00.1 I adding speculative implementation 'ngram-simple'\n")
    problem = speculation_problem(log, LLAMA_CPP_BY_NAME["ngram-then-dspark"])
    assert problem == "llama.cpp did not add the proposer(s) ['draft-dspark'] (it added ['ngram-simple'])"
    log.write_text("E failed to initialize speculative decoding context: bad tensor fc.weight\n")
    problem = speculation_problem(log, LLAMA_CPP_BY_NAME["dspark"])
    assert problem is not None and "bad tensor fc.weight" in problem


def test_the_command_line_of_each_method(tmp_path):
    tree = type("T", (), {"server": Path("/x/llama-server")})()
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"

    def cmd(name, **kw):
        spec = ServerSpec(target, LLAMA_CPP_BY_NAME[name], 7, 4096, draft_gguf=draft, threads=2, **kw)
        return spec.command(tree, host="127.0.0.1", port=9)

    def flag(c, f):
        return c[c.index(f) + 1] if f in c else None

    none = cmd("none")
    assert none[0] == "/x/llama-server" and flag(none, "-m") == str(target) and flag(none, "-np") == "1"
    assert flag(none, "-c") == "4096" and "--metrics" in none and "--spec-type" not in none and "-md" not in none
    assert flag(none, "--sse-ping-interval") == "-1"  # a ping mid-prefill fails vLLM's client's request
    chain = cmd("ngram-then-dspark", p_min=0.3)
    assert flag(chain, "--spec-type") == "ngram-simple,draft-dspark"  # the draftless proposer first
    assert flag(chain, "--spec-draft-n-max") == "7" and flag(chain, "--spec-ngram-simple-size-m") == "7"
    assert flag(chain, "--spec-ngram-simple-size-n") == "3" and flag(chain, "-md") == str(draft)
    assert flag(chain, "--spec-draft-p-min") == "0.3" and flag(chain, "-t") == flag(chain, "-td") == "2"
    ngram = cmd("ngram")
    assert flag(ngram, "--spec-type") == "ngram-simple" and "-md" not in ngram
    assert flag(cmd("dflash"), "--spec-type") == "draft-dflash"
    with pytest.raises(ValueError, match="needs a drafter GGUF"):
        ServerSpec(target, LLAMA_CPP_BY_NAME["dspark"], 7, 4096).command(tree, host="h", port=1)
    assert [m.name for m in LLAMA_CPP_METHODS] == ["none", "ngram", "dspark", "dflash", "ngram-then-dspark"]
    # one rule for every caller (issue #50): a dflash draft has no confidence head, so no p-min
    assert "--spec-draft-p-min" not in cmd("dflash", p_min=0.3) and "--spec-draft-p-min" not in cmd("ngram", p_min=0.3)
    assert "-ctk" not in chain and "-ctkd" not in chain  # llama.cpp's own default (f16) unless asked
    f32 = cmd("dspark", kv_cache_type="f32")
    assert [flag(f32, f) for f in ("-ctk", "-ctv", "-ctkd", "-ctvd")] == ["f32"] * 4
    plain = cmd("none", kv_cache_type="f32")
    assert flag(plain, "-ctk") == flag(plain, "-ctv") == "f32" and "-ctkd" not in plain


def _gguf(path: Path, file_type: int | None) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_f32_target_is_served_with_f32_caches_for_target_and_drafter(tmp_path):
    """Issue #49: parity with the f32 reference loop needs f32 caches, not llama.cpp's f16 default."""
    from dspark.serving.llama_cpp.server import kv_cache_type_for, server_spec

    f32, f16, unknown = _gguf(tmp_path / "a.gguf", 0), _gguf(tmp_path / "b.gguf", 1), _gguf(tmp_path / "c.gguf", None)
    assert kv_cache_type_for(f32) == "f32" and kv_cache_type_for(f16) is None and kv_cache_type_for(unknown) is None
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 64)  # llama-server, not the flag rule, refuses it
    assert kv_cache_type_for(tmp_path / "bad.gguf") is None and kv_cache_type_for(tmp_path / "none.gguf") is None
    spec = server_spec(f32, LLAMA_CPP_BY_NAME["dspark"], 7, 512, draft_gguf=tmp_path / "d.gguf")
    assert spec.kv_cache_type == "f32"
    assert server_spec(f16, LLAMA_CPP_BY_NAME["none"], 7, 512).kv_cache_type is None


def test_what_llama_cpp_cannot_serve_is_refused_in_one_line():
    assert llama_cpp_problem(DSparkConfig(), "dspark", "EXP") is None
    k3 = llama_cpp_problem(DSparkConfig(family="k3_mla"), "dspark", "EXP")
    assert (
        k3 is not None
        and k3.startswith("EXP: drafter family 'k3_mla'; llama.cpp serves Qwen3-style")
        and "\n" not in k3
    )
    gated = llama_cpp_problem(DSparkConfig(markov_head_type="gated"), "dspark", "EXP")
    assert gated is not None and "markov_head_type 'gated'" in gated and "vanilla" in gated
    # Markov off: its head type is moot, and its confidence head (on the state alone) is exported
    # with zero Markov columns (tests/dspark/test_export_bytes.py), the form llama.cpp reads
    assert llama_cpp_problem(DSparkConfig(markov_rank=0, markov_head_type="gated"), "dspark", "EXP") is None
    assert llama_cpp_problem(DSparkConfig(confidence_head_with_markov=False), "dspark", "EXP") is None


def test_the_auto_target_gguf_is_the_embedded_file_else_f16(tmp_path):
    """One rule for ``eval.llama_cpp_target=auto`` and ``dspark.export --gguf`` (issue #50)."""
    from dspark.export.gguf import target_gguf_type

    assert target_gguf_type("auto", tmp_path / "t.gguf") == "embedded"
    assert target_gguf_type("auto", None) == "f16"
    assert target_gguf_type("q8_0", tmp_path / "t.gguf") == "q8_0"


def test_llama_cpp_refuses_a_family_by_its_flag_not_its_name(monkeypatch):
    """``DrafterFamily.served_by_llama_cpp`` decides (issue #50): qwen3 without the flag is refused,
    k3_mla with it is not, and the refusal names the families that have it."""
    from dspark.families import FAMILIES

    monkeypatch.setattr(FAMILIES["qwen3"], "served_by_llama_cpp", False)
    monkeypatch.setattr(FAMILIES["k3_mla"], "served_by_llama_cpp", True)
    refused = llama_cpp_problem(DSparkConfig(), "dspark", "EXP")
    assert refused == (
        "EXP: drafter family 'qwen3'; llama.cpp serves Qwen3-style DSpark/DFlash drafters only "
        "(drafter.family=k3_mla); serve this one with vLLM on GPUs"
    )
    assert llama_cpp_problem(DSparkConfig(family="k3_mla"), "dspark", "EXP") is None


# --- the real build ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_cpp():
    """The build scripts/setup.sh made; CI (DSPARK_REQUIRE_LLAMA_CPP=1) fails without it."""
    from dspark.serving.llama_cpp.build import cache_dir, find

    tree = find()
    if tree is None:
        msg = f"llama.cpp is not built in {cache_dir()} (python -m dspark.serving.llama_cpp build)"
        if os.environ.get("DSPARK_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return tree


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, llama_cpp, tiny_trained_drafter):
    """(target GGUF f32, drafter GGUF f32, export dir, target dir): the tiny target and its 2-step
    drafter, exported and converted by llama.cpp's own converter."""
    from dspark.export import export
    from dspark.export.gguf import convert_export, target_gguf

    target_dir, _, ckpt = tiny_trained_drafter
    root = tmp_path_factory.mktemp("llama_cpp")
    exp = root / "export"
    export(ckpt, exp, layout="dspark", target_dir=target_dir)
    draft = convert_export(llama_cpp, exp, target_dir, "f32")
    target = target_gguf(llama_cpp, target_dir, "f32", cache=root / "cache")
    return target, draft, exp, target_dir


def _servers_left() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server"]


def _ckpt_of(pair) -> Path:
    import json

    return Path(json.loads((Path(pair[2]) / "export.json").read_text())["source"])


def _export_with_gguf(pair, out: Path, gguf_target: Path) -> subprocess.CompletedProcess:
    """``python -m dspark.export export CKPT --out OUT --gguf --gguf-target GGUF_TARGET`` of the pair's drafter."""
    cmd = [sys.executable, "-m", "dspark.export", "export", str(_ckpt_of(pair)), "--out", str(out)]
    cmd += ["--target-dir", str(pair[3]), "--gguf", "--gguf-target", str(gguf_target)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_export_cli_writes_the_gguf_beside_and_llama_cpp_drafts_with_it(tmp_path, llama_cpp, tiny_pair):
    out = tmp_path / "exp"
    run = _export_with_gguf(tiny_pair, out, tiny_pair[0])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    gguf = out.with_name("exp.f32.gguf")
    assert gguf.is_file() and f"llama.cpp drafter GGUF: {gguf}" in run.stdout
    assert "llama.cpp check:" in run.stdout and "as draft-dspark" in run.stdout
    assert not _servers_left()


@pytest.mark.slow
def test_a_drafter_of_another_target_is_refused_in_one_error_line(tmp_path, llama_cpp, tiny_pair):
    """The tiny drafter (2 layers x 64 wide) beside SmolLM2's Q4_1 file (576 wide): llama.cpp does
    not check a DSpark drafter against its target; we do, before serving."""
    from dspark.target import embedded_gguf_path

    run = _export_with_gguf(tiny_pair, tmp_path / "exp", embedded_gguf_path())
    assert run.returncode == 2, run.stderr[-3000:]
    err = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "fc reads 128 values per token (2 target layers)" in err[0], run.stderr[-2000:]
    assert "576 wide: 1152 expected" in err[0]
    assert "Traceback" not in run.stderr and not _servers_left()


def _prompts():
    from eval.eval_set import EvalPrompt

    base = [5, 17, 300, 4000, 12, 999, 5, 17, 300, 4000, 12, 77]
    return [
        EvalPrompt("0", 64, list(range(100, 164)), 64, "test", "", None, []),
        EvalPrompt("1", 64, base * 5, 60, "test", "", None, []),
    ]


def _assert_served_as_reference(served: list, prompts: list, exp_dir: Path, target_dir: Path, gamma: int, n: int):
    """Each served prompt's tokens, drafts and per-position acceptance equal the reference loop's
    (greedy, llama.cpp's last-block rule) for the export in ``exp_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from dspark.export.vllm_format import load_drafter, read_export
    from dspark.target import load_target_heads
    from eval.reference import DecodeConfig, DraftRunner, TargetRunner, speculative_generate

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    exp = read_export(exp_dir)
    drafter = load_drafter(exp, load_target_heads(target_dir))
    cfg = DecodeConfig(gamma=gamma, max_new_tokens=n, budget_blocks=True)
    for p, got in zip(prompts, served, strict=True):
        ref = speculative_generate(
            TargetRunner(model, exp.context_layer_ids),
            DraftRunner(drafter),
            p.prompt_token_ids,
            cfg,
            set(),
            torch.Generator().manual_seed(0),
        )
        assert got["output_ids"] == ref.tokens and got["num_drafts"] == ref.counts.num_drafts > 0, p.prompt_id
        assert got["accepted_per_pos"] == ref.counts.accepted_per_pos, p.prompt_id


@pytest.mark.slow
def test_every_method_gives_the_targets_greedy_tokens_and_llama_cpp_accepts_what_the_reference_does(
    tmp_path, llama_cpp, tiny_pair
):
    import torch
    from transformers import AutoModelForCausalLM

    from dspark.export.vllm_format import load_drafter, read_export
    from dspark.target import load_target_heads
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts
    from eval.reference import DecodeConfig, DraftRunner, TargetRunner, plain_generate, speculative_generate

    target, draft, exp_dir, target_dir = tiny_pair
    prompts, gamma, n = _prompts(), 4, 24
    s = LlamaCppServing(llama_cpp, target, ctx=512, gamma=gamma, max_new_tokens=n, temperature=0.0, seed=0)
    runs = {
        name: serve_prompts(s, LLAMA_CPP_BY_NAME[name], None if name in ("none", "ngram") else draft, prompts,
                            tmp_path / f"{name}.log")
        for name in ("none", "ngram", "dspark", "ngram-then-dspark")
    }  # fmt: skip
    assert not _servers_left()
    exp = read_export(exp_dir)
    heads = load_target_heads(target_dir)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cfg = DecodeConfig(gamma=gamma, max_new_tokens=n, budget_blocks=True)
    for i, p in enumerate(prompts):
        plain = plain_generate(TargetRunner(model, []), p.prompt_token_ids, cfg, set(), torch.Generator())
        for name, per_prompt in runs.items():
            rec = per_prompt[i]
            assert rec["output_ids"] == plain.tokens, (name, p.prompt_id)  # lossless: the target's own tokens
            assert rec["num_steps"] == n - 1 - rec["num_accepted"]  # no stop cut: every step accounted for
            assert rec["decode_tokens"] == n - 1 and rec["decode_ms"] > 0
        none = runs["none"][i]
        assert none["num_drafts"] == none["num_accepted"] == 0 and none["draft_ms"] == 0
        ref = speculative_generate(
            TargetRunner(model, exp.context_layer_ids),
            DraftRunner(load_drafter(exp, heads)),
            p.prompt_token_ids,
            cfg,
            set(),
            torch.Generator().manual_seed(0),
        )
        ours = runs["dspark"][i]
        assert ours["num_drafts"] == ref.counts.num_drafts and ours["num_accepted"] == ref.counts.num_accepted
        assert ours["accepted_per_pos"] == ref.counts.accepted_per_pos and ours["draft_ms"] > 0
        assert (
            set(ours["proposers"]) == {"draft-dspark"}
            and ours["proposers"]["draft-dspark"]["drafts"] == ours["num_drafts"]
        )
    # the chain: both proposers asked, each draft one proposer's (the random target repeats one token,
    # where ngram-simple never drafts: its most recent match overlaps the key and leaves < n to copy)
    for chain in runs["ngram-then-dspark"]:
        assert set(chain["proposers"]) == {"ngram-simple", "draft-dspark"}
        assert chain["num_drafts"] == sum(v["drafts"] for v in chain["proposers"].values())


@pytest.mark.slow
def test_a_markov_off_drafter_with_a_confidence_head_is_served_and_accepts_what_the_reference_does(
    tmp_path, llama_cpp, tiny_pair
):
    """The Markov-off ablation's confidence head reads the draft state alone; its export gives it a
    zero Markov column, and llama.cpp (which refused the state-only form) now serves it."""
    import dataclasses

    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.export import export
    from dspark.export.gguf import check_pair, convert_export
    from dspark.export.vllm_format import read_export
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts

    target, _, _, target_dir = tiny_pair
    ckpt = load_training_checkpoint(_ckpt_of(tiny_pair))
    h = ckpt.dims.hidden_size
    weights = {k: v for k, v in ckpt.weights.items() if not k.startswith("markov_head.")}
    weights["confidence_head.proj.weight"] = weights["confidence_head.proj.weight"][:, :h].contiguous()
    off = dataclasses.replace(ckpt, drafter=dataclasses.replace(ckpt.drafter, markov_rank=0), weights=weights)
    export(off, tmp_path / "off", layout="dspark", target_dir=target_dir)
    draft = convert_export(llama_cpp, tmp_path / "off", target_dir, "f32")
    check_pair(llama_cpp, target, draft, layout="dspark", gamma=4, log_dir=tmp_path / "check")
    gamma, n, prompts = 4, 24, _prompts()
    s = LlamaCppServing(llama_cpp, target, ctx=512, gamma=gamma, max_new_tokens=n, temperature=0.0, seed=0)
    served = serve_prompts(s, LLAMA_CPP_BY_NAME["dspark"], draft, prompts, tmp_path / "off.log")
    assert not _servers_left()
    exp = read_export(tmp_path / "off")
    assert exp.drafter.markov_rank == 0 and exp.weights["confidence_head.proj.weight"].shape == (1, h)
    _assert_served_as_reference(served, prompts, tmp_path / "off", target_dir, gamma, n)


@pytest.mark.slow
def test_a_windowed_drafter_is_converted_served_and_accepts_what_the_reference_does(tmp_path, llama_cpp, tiny_pair):
    """drafter.attention_window through llama.cpp (issue #47): its own converter turns the export's
    dflash_config (use_swa, swa_window_size) into the GGUF's sliding window with every layer sliding
    (src/models/dflash.cpp loads them into an iSWA cache), and llama-server's draft-dspark, on
    prompts of 60-64 tokens with a window of 16, drafts and accepts exactly what the reference loop
    does with the same window: the edge (a key at p0 hidden from a query at p when p - p0 >= W) is
    the same on both sides. Before the export wrote mask_token_id into dflash_config too, llama.cpp
    read mask id -1 and aborted on the first draft (get_sub_batch, error -2)."""
    import dataclasses

    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.export import export
    from dspark.export.gguf import convert_export, gguf_fields
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts

    target, _, _, target_dir = tiny_pair
    ckpt = load_training_checkpoint(_ckpt_of(tiny_pair))
    windowed = dataclasses.replace(ckpt, drafter=dataclasses.replace(ckpt.drafter, attention_window=16))
    export(windowed, tmp_path / "win", layout="dspark", target_dir=target_dir)
    draft = convert_export(llama_cpp, tmp_path / "win", target_dir, "f32")
    fields = gguf_fields(draft)
    arch = fields["general.architecture"]
    assert fields[f"{arch}.attention.sliding_window"] == 16
    assert list(fields[f"{arch}.attention.sliding_window_pattern"]) == [True] * ckpt.drafter.num_layers
    from gguf import GGUFReader  # gguf_fields leaves the tokenizer's fields out

    mask = GGUFReader(str(draft)).fields["tokenizer.ggml.mask_token_id"].contents()
    assert mask == json.loads((tmp_path / "win" / "config.json").read_text())["mask_token_id"]
    gamma, n, prompts = 4, 24, _prompts()
    s = LlamaCppServing(llama_cpp, target, ctx=512, gamma=gamma, max_new_tokens=n, temperature=0.0, seed=0)
    served = serve_prompts(s, LLAMA_CPP_BY_NAME["dspark"], draft, prompts, tmp_path / "win.log")
    assert not _servers_left()
    _assert_served_as_reference(served, prompts, tmp_path / "win", target_dir, gamma, n)


def test_a_shared_prefix_is_a_multiple_of_512_that_leaves_the_drafters_window_to_process():
    from dspark.serving.llama_cpp.server import N_UBATCH, shared_prefix_len

    assert N_UBATCH == 512
    assert shared_prefix_len(7168, 256) == 6656  # 512 tokens processed after the restore
    assert shared_prefix_len(1024, 256) == 512
    assert shared_prefix_len(769, 256) == 512 and shared_prefix_len(768, 256) == 0  # 257 left at least
    assert shared_prefix_len(1100, 16) == 1024
    assert shared_prefix_len(7168, None) == 0  # a whole-context drafter needs the whole prompt


@pytest.mark.slow
def test_a_shared_prefill_serves_what_a_whole_prefill_does_and_a_missing_slot_falls_back(
    tmp_path, llama_cpp, tiny_pair
):
    """Issue #60: the none server saves each prompt's first 512-multiple tokens, the drafter
    servers restore them and process only the rest (the drafter's window + 1 at least): every
    row's tokens, drafts, per-position acceptance and steps equal those of whole prefills, the
    restored rows processed only the tail (timings.cache_n), a prompt whose slot file is gone is
    prefilled whole with the same result, and the slots are removed at the end."""
    import dataclasses
    import random

    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.export import export
    from dspark.export.gguf import convert_export
    from eval.eval_set import EvalPrompt
    from eval.llama_cpp_rows import LlamaCppServing, SharedPrefill, serve_prompts

    target, _, _, target_dir = tiny_pair
    ckpt = load_training_checkpoint(_ckpt_of(tiny_pair))
    windowed = dataclasses.replace(ckpt, drafter=dataclasses.replace(ckpt.drafter, attention_window=16))
    export(windowed, tmp_path / "win", layout="dspark", target_dir=target_dir)
    draft = convert_export(llama_cpp, tmp_path / "win", target_dir, "f32")
    rng = random.Random(0)
    phrase = [rng.randrange(100, 4000) for _ in range(40)]  # repeated, so the n-gram proposer drafts too
    long_ids = lambda n: [rng.randrange(100, 4000) if rng.random() < 0.5 else phrase[i % 40] for i in range(n)]  # noqa: E731
    prompts = [EvalPrompt(str(i), n, long_ids(n), n, "test", "", None, []) for i, n in enumerate((700, 1100))]
    shared = SharedPrefill.of(tmp_path / "slots", target, prompts, [draft])
    assert shared is not None and shared.prefixes == {"0": 512, "1": 1024}
    s = LlamaCppServing(llama_cpp, target, ctx=1280, gamma=4, max_new_tokens=24, temperature=0.0, seed=0)
    rows = {"none": None, "dspark": draft, "ngram-then-dspark": draft}
    whole = {
        m: serve_prompts(s, LLAMA_CPP_BY_NAME[m], d, prompts, tmp_path / f"whole-{m}.log") for m, d in rows.items()
    }
    shared_rows = {}
    for m, d in rows.items():
        if m == "ngram-then-dspark":  # prompt 1's slot file is gone: prefilled whole
            (shared.slot_dir / shared.filename(list(prompts[1].prompt_token_ids), 1024)).unlink()
        shared_rows[m] = serve_prompts(s, LLAMA_CPP_BY_NAME[m], d, prompts, tmp_path / f"shared-{m}.log", shared)
    keys = ("output_ids", "num_drafts", "num_draft_tokens", "num_accepted", "accepted_per_pos", "num_steps")
    for m in rows:
        for a, b in zip(whole[m], shared_rows[m]):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (m, a["prompt_id"])
        assert [r["prompt_reused"] for r in whole[m]] == [0, 0]
    assert [r["prompt_reused"] for r in shared_rows["none"]] == [512, 1024]
    assert [r["prompt_reused"] for r in shared_rows["dspark"]] == [512, 1024]
    assert [r["prompt_reused"] for r in shared_rows["ngram-then-dspark"]] == [512, 0]
    assert sum(r["num_accepted"] for r in whole["ngram-then-dspark"]) > 0  # the counts compared are not all zero
    shared.remove()
    assert not shared.slot_dir.exists() and not _servers_left()


@pytest.mark.slow
def test_a_reduced_draft_vocabulary_is_served_through_d2t_and_accepts_what_the_reference_does(
    tmp_path, llama_cpp, tiny_pair
):
    """A drafter over 256 of the target's tokens (drafter.draft_vocab_size, issue #38 item 4): llama.cpp's
    converter reads its d2t and lm_head, and llama-server drafts target tokens through the map exactly
    as the reference loop does (the same tokens, the same acceptance per position)."""
    import dataclasses

    import torch

    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.data.draft_vocab import build_d2t, target_ids
    from dspark.export import export
    from dspark.export.gguf import check_pair, convert_export, gguf_fields
    from dspark.target import load_target_heads
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts

    target, _, _, target_dir = tiny_pair
    ckpt = load_training_checkpoint(_ckpt_of(tiny_pair))
    heads = load_target_heads(target_dir)
    prompts = _prompts()
    counts = torch.zeros(heads.vocab_size, dtype=torch.int64)
    for p in prompts:  # keep the prompts' tokens and the most common others (by id)
        counts[p.prompt_token_ids] += 1
    d2t = build_d2t(counts, 256)
    weights = dict(ckpt.weights, d2t=d2t)
    weights["markov_head.markov_w2.weight"] = ckpt.weights["markov_head.markov_w2.weight"][target_ids(d2t)]
    reduced = dataclasses.replace(
        ckpt, drafter=dataclasses.replace(ckpt.drafter, draft_vocab_size=256), weights=weights
    )
    export(reduced, tmp_path / "dv", layout="dspark", target_dir=target_dir)
    draft = convert_export(llama_cpp, tmp_path / "dv", target_dir, "f32")
    check_pair(llama_cpp, target, draft, layout="dspark", gamma=4, log_dir=tmp_path / "check")
    gamma, n = 4, 24
    s = LlamaCppServing(llama_cpp, target, ctx=512, gamma=gamma, max_new_tokens=n, temperature=0.0, seed=0)
    served = serve_prompts(s, LLAMA_CPP_BY_NAME["dspark"], draft, prompts, tmp_path / "dv.log")
    assert not _servers_left()
    _assert_served_as_reference(served, prompts, tmp_path / "dv", target_dir, gamma, n)
    assert gguf_fields(draft)  # the GGUF reads back


@pytest.mark.slow
def test_the_serving_benchmark_drives_llama_server_with_vllms_client_and_counts_from_its_metrics(
    tmp_path, llama_cpp, tiny_pair
):
    """serve_bench's llama.cpp configurations: llama-server started by the same code, vLLM's own
    benchmark client against its OpenAI endpoint, the counters from llama-server's /metrics;
    every step accounted for, every request answered (llama-server closes a kept-alive connection
    after a stream: requests in a row failed on it before the client opened one per request), and
    nothing left running."""
    import json

    from dspark.config import ServeBenchConfig
    from eval.serve_bench.server import Configuration
    from eval.serve_bench.stage import BenchSetup, bench_config

    target, draft, _, target_dir = tiny_pair
    traffic = tmp_path / "traffic.jsonl"
    words = "the cat sat on the mat and the dog sat on the log " * 6
    traffic.write_text("".join(json.dumps({"prompt": words + str(i)}) + "\n" for i in range(6)))
    sb = ServeBenchConfig(concurrency=[1], output_len=16, temperature=0.0, num_warmups=1, start_timeout_s=300)
    setup = BenchSetup(
        target=target_dir,
        traffic=traffic,
        templated=True,
        num_requests=6,
        max_model_len=512,
        gamma=4,
        dtype="float32",
        seed=0,
        engine_kwargs={},
        kvcache_gib=1,
        gpu=False,
        llama_cpp=(llama_cpp, target),
        warmup_prompt=words,
        warmup_tokens=16,
    )
    none = bench_config(Configuration("llama.cpp-none", engine="llama.cpp"), setup, sb, tmp_path)
    ours = bench_config(Configuration("llama.cpp-dspark", "dspark", draft, engine="llama.cpp"), setup, sb, tmp_path)
    assert not _servers_left()
    (n1,), (o1,) = none.levels, ours.levels
    assert n1.spec is None and n1.metrics["output_tokens_per_s"] > 0 and o1.metrics["output_tokens_per_s"] > 0
    for lv in (n1, o1):
        assert lv.metrics["completed"] == 6 and lv.metrics["failed"] == 0
        assert lv.metrics["total_output_tokens"] == 6 * 16  # the server's count (EOS ignored)
    s = o1.spec  # 6 requests x 16 tokens: 6 from prefill, the rest from steps of 1 + accepted
    assert s["num_steps"] + s["num_accepted"] == 6 * 16 - 6
    # the drafter drafts on every step but, at most, a request's last (a single token left)
    assert s["num_steps"] - 6 <= s["num_drafts"] <= s["num_steps"] and s["num_draft_tokens"] >= s["num_drafts"]


@pytest.mark.slow
def test_a_server_that_does_not_come_up_is_one_error_naming_its_log_and_nothing_is_left(tmp_path, llama_cpp):
    from dspark.serving.server_lifecycle import ServerStartError
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts

    bad = tmp_path / "target.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    s = LlamaCppServing(llama_cpp, bad, ctx=256, gamma=4, max_new_tokens=4, temperature=0.0, seed=0)
    log = tmp_path / "none.log"
    with pytest.raises(ServerStartError) as e:
        serve_prompts(s, LLAMA_CPP_BY_NAME["none"], None, _prompts(), log)
    assert str(e.value).startswith("llama.cpp none: the llama.cpp server exited with status")
    assert f"its log: {log}" in str(e.value) and not _servers_left()


def _fake_sdist(path: Path, cmakelists: str) -> Path:
    from dspark.serving.llama_cpp.build import SDIST_FILE

    name = SDIST_FILE.removesuffix(".tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        data = cmakelists.encode()
        info = tarfile.TarInfo(f"{name}/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_a_failed_build_names_its_log_and_leaves_nothing_that_looks_built(tmp_path, monkeypatch):
    import dspark.serving.llama_cpp.build as lc

    sdist = _fake_sdist(
        tmp_path / "sdist.tar.gz", 'cmake_minimum_required(VERSION 3.14)\nmessage(FATAL_ERROR "boom")\n'
    )
    monkeypatch.setenv(lc.SDIST_ENV, str(sdist))
    monkeypatch.setattr(lc, "SDIST_SHA256", lc.file_sha256(sdist))
    with pytest.raises(lc.LlamaCppBuildError) as e:
        lc.ensure_built(tmp_path / "cache", jobs=1)
    msg = str(e.value)
    log = Path(msg.split("its log: ")[1].split("\n")[0])
    assert msg.startswith("the llama.cpp build failed at 'configure' (exit 1)") and log.is_file()
    assert "boom" in log.read_text() and "boom" in msg
    assert lc.find(tmp_path / "cache") is None
    assert not [p for p in (tmp_path / "cache" / "llama.cpp").iterdir() if p.is_dir()]  # no half tree


def test_a_sdist_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    import dspark.serving.llama_cpp.build as lc

    sdist = _fake_sdist(tmp_path / "sdist.tar.gz", "project(x)\n")
    monkeypatch.setenv(lc.SDIST_ENV, str(sdist))
    with pytest.raises(lc.LlamaCppError, match=f"sha256 {lc.file_sha256(sdist)}, expected {lc.SDIST_SHA256}"):
        lc.ensure_built(tmp_path / "cache")


def test_the_sdist_is_fetched_through_pips_own_index_settings(tmp_path, monkeypatch):
    """Issue #49: the sdist came from a hard-coded registry URL, so a user's mirror, proxy or
    private index (pip.conf, PIP_INDEX_URL) did not apply. Here pip's index is a local directory
    that only pip's settings name; the fetch finds the file there and checks its sha256."""
    import dspark.serving.llama_cpp.build as lc

    index = tmp_path / "simple"
    (index / lc.SDIST).mkdir(parents=True)
    served = _fake_sdist(index / lc.SDIST / lc.SDIST_FILE, "project(x)\n")
    page = f'<html><body><a href="{lc.SDIST_FILE}">{lc.SDIST_FILE}</a></body></html>\n'
    (index / lc.SDIST / "index.html").write_text(page)  # a simple index page (PEP 503), as a mirror serves
    monkeypatch.delenv(lc.SDIST_ENV, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # the machine's own pip settings out of the way
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setattr(lc, "SDIST_SHA256", lc.file_sha256(served))
    got = lc._sdist(tmp_path / "cache")
    assert got == tmp_path / "cache" / lc.SDIST_FILE and got.read_bytes() == served.read_bytes()
    served.unlink()
    (tmp_path / "cache" / lc.SDIST_FILE).unlink()
    with pytest.raises(lc.LlamaCppError) as e:  # listed, gone: one line, nothing half written kept
        lc._sdist(tmp_path / "cache")
    assert str(e.value).startswith(f"fetching {lc.SDIST_FILE} through pip failed (HTTPError: 404")
    assert list((tmp_path / "cache").iterdir()) == []
    (index / lc.SDIST / "index.html").write_text("<html><body></body></html>\n")
    with pytest.raises(lc.LlamaCppError) as e:
        lc._sdist(tmp_path / "cache")
    assert str(e.value).startswith(f"{lc.SDIST}=={lc.SDIST_VERSION}: pip's index ({index.as_uri()}) lists no ")
    assert str(e.value).endswith(f"set {lc.SDIST_ENV} to it") and not (tmp_path / "cache" / lc.SDIST_FILE).exists()


def test_no_package_registry_host_in_the_code():
    """Issue #49: installs go through pip, so the user's index settings apply."""
    hosts = ("pythonhosted.org", "pypi.org", "pypi.python.org")
    found = [
        f"{p}: {h}"
        for d in ("dspark", "eval", "data_tools", "scripts", "slurm", "conf")
        for p in sorted((REPO / d).rglob("*"))
        if p.is_file() and p.suffix in {".py", ".sh", ".sbatch", ".yaml", ".md", ".toml"}
        for h in hosts
        if h in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert found == []


@pytest.mark.slow
def test_the_quantized_files_run_on_the_portable_build(tmp_path, llama_cpp, tiny_pair):
    """The wheel's Q4_1 target and a q8_0 drafter: the build for every x86-64 machine runs them
    (a -march=native build died with SIGILL on both, issue #36) with a CPU variant it chose."""
    from dspark.export.gguf import check_pair, convert_export
    from dspark.target import embedded_gguf_path
    from eval.llama_cpp_rows import LlamaCppServing, serve_prompts

    target, _, exp_dir, target_dir = tiny_pair
    q8 = convert_export(llama_cpp, exp_dir, target_dir, "q8_0")
    assert q8.name == "export.q8_0.gguf" and q8.stat().st_size < exp_dir.joinpath("model.safetensors").stat().st_size
    check = check_pair(llama_cpp, target, q8, layout="dspark", gamma=4, log_dir=tmp_path)
    assert check.drafts >= 1 and check.spec_type == "draft-dspark"
    s = LlamaCppServing(llama_cpp, embedded_gguf_path(), ctx=256, gamma=4, max_new_tokens=8, temperature=0.0, seed=0)
    log = tmp_path / "q4_1.log"
    (rec,) = serve_prompts(s, LLAMA_CPP_BY_NAME["none"], None, _prompts()[:1], log)
    assert len(rec["output_ids"]) == 8 and rec["num_steps"] == 7
    variant = [line for line in log.read_text().splitlines() if "loaded CPU backend from" in line]
    assert variant and "libggml-cpu-" in variant[0], log.read_text()[-2000:]
    assert not _servers_left()

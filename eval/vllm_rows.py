"""Acceptance as vLLM counts it: serve the target with a speculative method (``ngram``, ``dflash``
with our fill-in export, ``dspark`` with our export on GPUs) and read its spec-decode counters.

One engine per method, one process per engine (vLLM spawns workers): ``python -m eval.serve``
(:mod:`eval.serve`, the command line) runs :func:`serve` on a :class:`ServeSpec`.
A warm-up request runs first, then the prompts one at a time (batch size
1, the single-stream case the drafter is for), and the counters are read before and after each
prompt, so warm-up is excluded and every prompt (and bin) gets its own figures.

Steps are the engine's own counter: ``vllm:inter_token_latency_seconds`` observes one value per
request per engine step that gave it new tokens after its first, so at one request at a time its
count is the number of verification steps, drafted or not, the last one included even when the
stop cut some of its tokens. ``generated - 1 - accepted`` (from the outputs) is kept beside it
as a check: it is lower by exactly the accepted tokens that a stop cut off.

"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dspark.serving.methods import speculative_config
from dspark.serving.vllm_engine import generate, make_llm
from eval.acceptance import AcceptanceCounts

log = logging.getLogger(__name__)

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
STEPS = "vllm:inter_token_latency_seconds"  # a histogram: one observation per decode step per request


@dataclass
class ServeRun:
    """What one engine produced: counters per bin (warm-up excluded) and the generated tokens."""

    method: str
    draft: Optional[str]
    gamma: int
    per_bin: dict[str, dict[str, Any]]  # str(bin) -> AcceptanceCounts fields
    outputs: dict[str, list[int]]  # prompt_id -> generated token ids
    engine_start_s: float
    generate_s: float
    per_prompt: list[dict[str, Any]] = field(default_factory=list)  # {prompt_id, bin, **AcceptanceCounts fields}


def read_counters(llm: Any, gamma: int) -> AcceptanceCounts:
    """The cumulative spec-decode counters of an engine (``LLM.get_metrics``)."""
    counts = AcceptanceCounts(gamma)
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            setattr(counts, COUNTERS[m.name], getattr(counts, COUNTERS[m.name]) + int(m.value))
        elif m.name == PER_POS:
            values = list(m.values)[:gamma]
            counts.accepted_per_pos = [
                a + int(b) for a, b in zip(counts.accepted_per_pos, values + [0] * (gamma - len(values)))
            ]
        elif m.name == STEPS:
            counts.num_steps += int(m.count)
    return counts


def steps_from_outputs(num_generated: int, num_accepted: int) -> int:
    """Verification steps of one request from its output and vLLM's accepted counter: the first
    token comes from prefill, each later step gives 1 + its accepted tokens. Lower than the true
    count by the accepted tokens a stop (EOS, max_tokens) cut from the last step."""
    return max(num_generated - 1 - num_accepted, 0)


@dataclass
class ServeSpec:
    """One engine: the target served with one speculative method, over one eval set."""

    target: Path
    method: str
    prompts_file: Path
    gamma: int
    max_model_len: int
    cpu_kvcache_gib: int
    max_new_tokens: int
    temperature: float
    dtype: str
    seed: int
    draft: Optional[Path] = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The command-line arguments of ``python -m eval.serve`` for this spec."""
        args = [
            "--target",
            str(self.target),
            "--method",
            self.method,
            "--prompts",
            str(self.prompts_file),
            "--gamma",
            str(self.gamma),
            "--max-new-tokens",
            str(self.max_new_tokens),
            "--temperature",
            str(self.temperature),
            "--max-model-len",
            str(self.max_model_len),
            "--cpu-kvcache-gib",
            str(self.cpu_kvcache_gib),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
        ]
        if self.draft is not None:
            args += ["--draft", str(self.draft)]
        if self.engine_kwargs:
            args += ["--engine-kwargs", json.dumps(self.engine_kwargs)]
        return args

    def llm_kwargs(self) -> dict[str, Any]:
        return dict(
            model=str(self.target),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enforce_eager=True,
            speculative_config=speculative_config(self.method, self.draft, self.gamma),
            **self.engine_kwargs,
        )


def serve(spec: ServeSpec) -> ServeRun:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eval.eval_set import load_eval_set

    prompts = load_eval_set(spec.prompts_file)
    t0 = time.perf_counter()
    llm = make_llm(
        dict(spec.llm_kwargs(), seed=spec.seed, disable_log_stats=False), cpu_kvcache_gib=spec.cpu_kvcache_gib
    )
    start_s = time.perf_counter() - t0
    gamma = spec.gamma
    params = SamplingParams(
        max_tokens=spec.max_new_tokens, temperature=spec.temperature, seed=spec.seed, ignore_eos=False
    )
    warm = prompts[0].prompt_token_ids[-64:]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    per_bin, outputs, per_prompt = {}, {}, []
    t1 = time.perf_counter()
    for b in sorted({p.bin for p in prompts}):
        group = [p for p in prompts if p.bin == b]
        total = AcceptanceCounts(gamma)
        for i, p in enumerate(group):
            before = read_counters(llm, gamma)
            (result,) = generate(
                llm,
                [TokensPrompt(prompt_token_ids=list(p.prompt_token_ids))],
                params,
                use_tqdm=False,
                what=f"serving {spec.method}, bin {b}, prompt {p.prompt_id}",
                rerun="rerun the eval stage (the exports and finished results are kept)",
            )
            delta = read_counters(llm, gamma).minus(before)
            tokens = list(result.outputs[0].token_ids)
            check = steps_from_outputs(len(tokens), delta.num_accepted)
            if not check <= delta.num_steps <= check + gamma:
                raise RuntimeError(
                    f"{spec.method}, prompt {p.prompt_id}: the engine counted {delta.num_steps} steps, the outputs "
                    f"say {check} to {check + gamma} ({len(tokens)} tokens, {delta.num_accepted} accepted): "
                    f"{STEPS} no longer counts one per step in this vLLM"
                )
            outputs[p.prompt_id] = tokens
            per_prompt.append({"prompt_id": p.prompt_id, "bin": b, **asdict(delta), "steps_from_outputs": check})
            total.merge(delta)
            log.info(
                "%s bin %d prompt %d/%d: %d tokens in %d steps, %d drafts",
                spec.method,
                b,
                i + 1,
                len(group),
                len(tokens),
                delta.num_steps,
                delta.num_drafts,
            )
        per_bin[str(b)] = {**asdict(total), "num_prompts": len(group)}
        log.info(
            "%s bin %d: %d prompts, tokens/step %.3f, tau %.3f over %.0f%% drafted steps",
            spec.method,
            b,
            len(group),
            total.tokens_per_step,
            total.tau,
            100 * total.draft_share,
        )
    draft = str(spec.draft) if spec.draft else None
    return ServeRun(spec.method, draft, gamma, per_bin, outputs, start_s, time.perf_counter() - t1, per_prompt)


def run_in_subprocess(spec: ServeSpec, out: Path, *, timeout: int = 3600) -> ServeRun:
    """Run :func:`serve` in a fresh process (vLLM wants its own main module) and read its JSON.
    Bounded: past ``timeout`` seconds the child, its engine core and workers are killed and
    :class:`~dspark.core.waits.WaitTimedOut` names the child, its log and what to do."""
    from dspark.core.waits import log_tail, run_child

    cmd = [sys.executable, "-m", "eval.serve", *spec.argv(), "--out", str(out)]
    method = spec.method
    log_file = out.with_suffix(".log")
    log.info("vLLM %s: %s (log: %s)", method, " ".join(cmd), log_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(out).unlink(missing_ok=True)  # only what this child writes is read back
    rc = run_child(
        cmd,
        cwd=Path(__file__).resolve().parents[1],
        log_file=log_file,
        timeout_s=timeout,
        what=f"the vLLM {method} engine (python -m eval.serve --method {method})",
        todo="read its log for where it stopped (engine start, a multi-node peer, generation), then rerun the "
        "eval stage (finished parts are kept), with a larger eval.vllm_timeout_s if it was only slow",
    )
    if rc != 0:
        raise RuntimeError(
            f"vLLM {method} run failed (exit {rc}): {' '.join(cmd)}\nlast lines of {log_file}:\n{log_tail(log_file)}"
        )
    return load_run(out)


def load_run(path: Path) -> ServeRun:
    return ServeRun(**json.loads(Path(path).read_text()))

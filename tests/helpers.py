"""Shared test helpers: reference outputs to compare against (transformers' own greedy decoding, the
exact distribution of the first two sampled tokens), a chi-square test of sampled output, and the CLI as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
from scipy.stats import chisquare

PROMPTS = ["def quicksort(arr):\n", "The quick brown fox", "import numpy as np\nfor i in range(10):"]


from mirrorsd.runtime.backends.invariance import probe_tokens as invariance_tokens  # noqa: E402,F401


def hf_greedy(model, tokenizer, prompt: str, n: int, **kw) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    return out[0, ids.shape[1]:].tolist()


def exact_first_two(model, tokenizer, cfg, prompt) -> tuple[np.ndarray, np.ndarray]:
    """Exact P(t1) and marginal P(t2) of target-only sampling, from the model's logits."""
    from mirrorsd.runtime.decode.sampling import next_token_scores

    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        p1 = next_token_scores(model(torch.tensor([ids])).logits[0, -1:], cfg.sampling, ids,
                               prompt_len=len(ids))[0].double().numpy()
        vocab = p1.shape[0]
        batch = torch.tensor([ids + [t] for t in range(vocab)])  # [V, L+1]
        last = model(batch).logits[:, -1]  # [V, V]
        p2_given = torch.cat([next_token_scores(last[t : t + 1], cfg.sampling, ids + [t], prompt_len=len(ids))
                              for t in range(vocab)]).double().numpy()
    return p1, p1 @ p2_given


def pvalue(samples, probs) -> float:
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * len(samples)
    big = expected >= 5  # pool the rare tokens into one bin so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue


def sample_first_two(engine, prompt, cfg, seeds: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The first two tokens of `seeds` seeded generations, and how many tokens were drafted in all."""
    from dataclasses import replace

    first, second, drafted = [], [], 0
    for seed in range(seeds):
        result = engine.generate(prompt, replace(cfg, seed=seed))
        first.append(result.token_ids[0])
        second.append(result.token_ids[1])
        drafted += result.stats.drafted_tokens
    return np.array(first), np.array(second), drafted


def assert_distribution(engine, prompt, cfg, p1, p2, seeds: int, min_drafted: int) -> None:
    """Sampled first/second tokens follow the exact target distributions p1 / p2 (chi-square), with the
    drafter really drafting."""
    first, second, drafted = sample_first_two(engine, prompt, cfg, seeds)
    assert drafted > min_drafted  # the drafter really drafted
    assert pvalue(first, p1) > 1e-3
    assert pvalue(second, p2) > 1e-3


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """A server's /health once its engine is idle (nothing running, nothing queued)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if not health["busy"] and health["queued"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the engine stayed busy: {health}")


CLI = [sys.executable, "-m", "mirrorsd"]


def run(*args, env=None, stdin=None):
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def run_all(*commands, env=None, stdin=None):
    """run(*args) for each of a test's independent commands, as many at once as there are cores: their start-ups
    (torch's import, a model's load) overlap instead of adding up. Results in the commands' order; stdin goes to
    each (only a command that reads it, as generate's '-', sees it)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda args: run(*args, env=env, stdin=stdin), commands))


def decode_steps(target, drafter, prompt_ids, config, max_new_tokens: int, mode: str = "branches"):
    """A request's steps as the engine runs them (make_plan for `mode`, a DecodeState, run_plan), for tests that
    look at single steps below the engine."""
    from mirrorsd.runtime.decode.loop import run_plan
    from mirrorsd.runtime.decode.plan import make_plan
    from mirrorsd.runtime.decode.verify import DecodeState

    plan = make_plan(target, drafter, config, mode)
    state = DecodeState(target, prompt_ids, config, max_new_tokens, overlapped=plan.mode != "off",
                        model_drafts=drafter is not None and drafter.model is not None)
    return run_plan(state, drafter, None, plan)

"""`mirrorsd eval-drafts` on a tiny workload: offline acceptance counted exactly, the report complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import make_model
from drafters_for_tests import RandomTokenDrafter, ScriptedDrafter
from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.eval_drafts import EvalOptions, run_eval_drafts
from mirrorsd.runtime.replay import replay_acceptance
from mirrorsd.runtime.drafters import NGramDrafter

PROMPTS = ["def quicksort(arr):", "The quick brown fox", "import numpy as np", '{"name": "mirrorsd",',
           "for i in range(10):", "Hello world!"]


@pytest.fixture(scope="module")
def engine(tokenizer, target_model):
    return Engine(target_model, tokenizer, name="tiny")


@pytest.fixture(scope="module")
def references(engine):
    """(prompt ids, the target's greedy output) per prompt."""
    cfg = GenerationConfig(max_new_tokens=20)
    out = []
    for p in PROMPTS:
        ids = engine.encode(p)
        out.append((ids, engine.generate(ids, cfg).token_ids))
    return out


def test_replay_acceptance_counts_what_a_scripted_drafter_gets_right(references, tokenizer):
    ids, target = references[0]
    assert len(target) == 20
    exact = replay_acceptance(ScriptedDrafter([ids + target], len(tokenizer)), ids, target, k=4)
    # Steps at 0, 5, 10, 15: 4 drafted, 4 accepted, plus the bonus token each.
    assert exact.alpha == 1.0 and exact.pos_trials == exact.pos_accepted == [4, 4, 4, 4]
    assert exact.committed == 20 and exact.steps == 4
    two = replay_acceptance(ScriptedDrafter([ids + target], len(tokenizer), correct=2), ids, target, k=4)
    # Each step: 2 accepted, the 3rd position reached and rejected, so commits 3 tokens; 20 = 6 * 3 + 2.
    assert [a / t for a, t in zip(two.pos_accepted, two.pos_trials)] == [1.0, 1.0, 0.0]
    assert two.steps == 7 and two.committed == 20 and two.accepted == 13
    assert two.alpha == pytest.approx(13 / (6 * 3 + 1))  # last step: budget 1, one token drafted and accepted
    noise = replay_acceptance(RandomTokenDrafter(len(tokenizer)), ids, target, k=4)
    assert noise.alpha < 0.2 and noise.steps >= 15


def test_eval_drafts_on_a_tiny_workload(engine, references, tokenizer, tmp_path):
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    oracle = ScriptedDrafter([ids + out for ids, out in references], len(tokenizer))
    opts = EvalOptions(workload=str(workload), target="tiny", samples=4, max_new_tokens=20, k_max=6,
                       price_per_hour=2.5, out=str(tmp_path / "out"))
    report = run_eval_drafts(opts, engine=engine, candidates={"ngram": NGramDrafter(), "oracle": oracle,
                                                              "noise": RandomTokenDrafter(len(tokenizer))})
    assert report["samples"] == 4 and report["workload_size"] == len(PROMPTS)
    rows = report["candidates"]
    assert rows["oracle"]["alpha"] == 1.0 and rows["oracle"]["best_k"] == 6
    assert rows["noise"]["alpha"] < 0.2
    for row in rows.values():
        assert row["greedy_equal"] is True  # measured end to end through the real engine
        assert len(row["predicted_speedup_by_k"]) == 6 and row["cost_ratio_c"] >= 0
        assert row["measured_tokens_per_second"] > 0 and row["alpha_by_draft_position"]
        assert set(row["alpha_by_sequence_position"]) <= {"0-15", "16-31"}
    rec = report["recommendation"]
    assert rec["drafter"] in (None, *rows)
    tps = report["target_only_tokens_per_second"]
    assert report["cost"]["target_only_per_million_tokens"] == pytest.approx(2.5 / (tps * 3600) * 1e6, rel=1e-3)
    saved = json.loads((tmp_path / "out" / "eval-drafts.json").read_text())
    assert saved["candidates"]["oracle"]["alpha"] == 1.0
    assert "Recommendation" in (tmp_path / "out" / "eval-drafts.md").read_text()


def test_ctrl_c_writes_what_was_measured_so_far(engine, tokenizer, tmp_path, monkeypatch):
    """Ctrl-C during the end-to-end runs: the prompts every runner finished are in a partial report (it wrote
    nothing and exited 130 silently)."""
    import mirrorsd.apps.bench.eval_drafts as eval_drafts

    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    real_ours, runs = eval_drafts.ours, []

    def ours(ctx, drafter, **kw):
        run = real_ours(ctx, drafter, **kw)
        if drafter is None:
            return run

        def interrupting(ids, config):  # the candidate's third end-to-end prompt is where Ctrl-C lands
            runs.append(1)
            if len(runs) == 3:
                raise KeyboardInterrupt
            return run(ids, config)
        return interrupting

    monkeypatch.setattr(eval_drafts, "ours", ours)
    opts = EvalOptions(workload=str(workload), target="tiny", samples=4, max_new_tokens=12, k_max=4,
                       out=str(tmp_path / "out"))
    with pytest.raises(KeyboardInterrupt):
        run_eval_drafts(opts, engine=engine, candidates={"ngram": NGramDrafter()})
    saved = json.loads((tmp_path / "out" / "eval-drafts.json").read_text())
    assert saved["partial"] and saved["measured_samples"] == 2 and "2 of 4 prompts" in saved["interrupted"]
    assert saved["candidates"]["ngram"]["measured_tokens_per_second"] > 0
    assert "Partial report" in (tmp_path / "out" / "eval-drafts.md").read_text()


def test_eval_drafts_command_line(tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    make_model(tokenizer, seed=0, sharpness=30.0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS[:3]))
    cmd = [sys.executable, "-m", "mirrorsd", "eval-drafts", str(workload), "--target", str(folder),
           "--drafter", "ngram", "--samples", "2", "--max-new-tokens", "12", "--k-max", "4", "--out", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "ngram" in json.loads((tmp_path / "o" / "eval-drafts.json").read_text())["candidates"]
    bad = subprocess.run([*cmd[:4], str(tmp_path / "missing.jsonl"), *cmd[5:]], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr

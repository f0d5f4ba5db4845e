"""The pipeline with the verifier on a GPU and the draft on the CPU: sequential / overlap /
branches side by side in one run, tokens/s, hidden draft share and greedy equality with target-only
decoding on the same GPU.

    python scripts/gpu_pipeline.py --prompts he.jsonl [--target smollm2-135m] [--draft smollm2-135m]
        [--device cuda] [--max-new-tokens 64] [--out DIR]

Rows: target only; the model-free chain; the draft model as torch on the GPU, as torch on the CPU, and as
the GGUF on llama.cpp's CPU kernels (where llama-cpp-python imports), each in every pipeline mode and
"auto" (shown with the mode its calibration picked). Each
draft row runs twice: as a user gets it (the speculation gate may pause a draft that does not pay) and with
the gate held open, which measures the pipeline itself. Every row's greedy text is compared token for token
with target-only decoding on the same device. Writes report.md and report.json to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.decode.policy import step_policy
from mirrorsd.runtime.decode.policy.gate import SpeculationGate

MODES = ("off", "overlap", "branches", "auto")


@contextmanager
def gate_open(open_: bool):
    """Hold the speculation gate open (measuring the pipeline, not the gate's choice)."""
    if not open_:
        yield
        return
    original = step_policy.SpeculationGate
    step_policy.SpeculationGate = lambda enabled=True, **kw: SpeculationGate(enabled=False, **kw)
    try:
        yield
    finally:
        step_policy.SpeculationGate = original


def run_row(engine: Engine, prompts: list, mode: str, tokens: int, reference: list | None) -> dict:
    n = seconds = drafted = accepted = steps = 0
    draft_s = hidden_s = verify_s = 0.0
    equal, texts = 0, []
    served: dict[str, int] = {}
    ran: set[str] = set()
    for i, messages in enumerate(prompts):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        engine.reset()  # a cold start: no prompt prefix kept from the run before
        start = time.perf_counter()
        result = engine.generate(messages, GenerationConfig(max_new_tokens=tokens, pipeline=mode))
        seconds += time.perf_counter() - start
        s = result.stats
        n += s.generated_tokens
        steps += s.verify_steps
        drafted += s.drafted_tokens
        accepted += s.accepted_tokens
        draft_s += s.draft_time_s
        hidden_s += s.draft_hidden_s
        verify_s += s.verify_time_s
        for source, k in s.drafters.items():
            served[source] = served.get(source, 0) + k
        ran.add(s.pipeline)
        texts.append(list(result.token_ids))
        equal += reference is None or list(result.token_ids) == reference[i]
    shown = mode if mode != "auto" else "auto: " + "/".join(sorted(ran))  # the mode(s) auto resolved to
    return {"mode": shown, "tokens": n, "seconds": round(seconds, 3), "tok_s": round(n / seconds, 2),
            "verify_steps": steps, "tokens_per_step": round(n / steps, 2) if steps else None,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "hidden_share": round(hidden_s / draft_s, 3) if draft_s and mode != "off" else None,
            "draft_s": round(draft_s, 3), "verify_s": round(verify_s, 3), "served": served,
            "greedy_equal": f"{equal}/{len(prompts)}", "token_ids": texts}


def write_report(out: Path, args, rows: list, n_prompts: int, final: bool = True) -> None:
    """report.json and report.md; written after every row, so a row that kills the process loses no other."""
    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "cpu_threads": torch.get_num_threads()}
    settings = vars(args) | {"prompts_n": n_prompts, "dtype": "float32", "greedy": True}
    (out / "report.json").write_text(json.dumps({"machine": machine, "settings": settings, "rows": rows}, indent=1))
    target_tok_s = rows[0]["tok_s"]
    lines = [f"# The pipeline with the verifier on {machine['gpu'] or args.device}", "",
             f"{machine['platform']}, torch {machine['torch']}, {machine['cpu_threads']} CPU threads. Target "
             f"{args.target} (torch float32 on {args.device}), {n_prompts} prompts, {args.max_new_tokens} new "
             "tokens, greedy. 'gate held open': the speculation gate disabled, so every step drafts.", "",
             "| draft | gate | mode | tok/s | vs target only | tokens/step | acceptance | hidden | draft s | "
             "verify s | greedy equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r.get('gate', '')} | {r.get('mode', '')} | error: {r['error']} "
                         "| | | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['gate']} | {r['mode']} | {r['tok_s']} | {r['tok_s'] / target_tok_s:.2f}x "
                     f"| {r['tokens_per_step']} | {r['acceptance']} | {r['hidden_share']} | {r['draft_s']} | "
                     f"{r['verify_s']} | {r['greedy_equal']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="JSONL of {\"messages\": [...]}")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="gpu-pipeline")
    args = ap.parse_args()
    prompts = [json.loads(line)["messages"] for line in open(args.prompts) if line.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    engine = Engine.load(args.target, draft="none", device=args.device, backend="torch", dtype="float32")
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=32))  # warm-up: kernels, allocator
    rows = [dict(config="target only", gate="-", **run_row(engine, prompts, "off", args.max_new_tokens,
                                                               None))]
    reference = rows[0]["token_ids"]
    print(f"target only: {rows[0]['tok_s']} tok/s", flush=True)

    drafts = [("chain (n-gram + retrieval)", "chain", {}),
              (f"{args.draft} torch on {args.device}", args.draft, dict(draft_device=args.device)),
              (f"{args.draft} torch on cpu", args.draft, dict(draft_device="cpu")),
              (f"{args.draft} llama.cpp on cpu", args.draft, dict(draft_device="cpu", draft_backend="llamacpp"))]
    for label, draft, where in drafts:
        try:
            drafted = Engine.load(args.target, draft=draft, device=args.device, backend="torch", dtype="float32",
                                  **where)
        except Exception as exc:  # a row that cannot load (no llama.cpp here) is reported, the rest still run
            rows.append({"config": label, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{label}: {rows[-1]['error']}", flush=True)
            continue
        with gate_open(True):  # warm-up: every verify shape seen once, so no row pays first-use costs
            drafted.generate(prompts[0], GenerationConfig(max_new_tokens=32, pipeline="off"))
        modes = ("off",) if draft == "chain" else MODES
        for held_open in (False, True):
            with gate_open(held_open):
                for mode in modes:
                    try:
                        row = run_row(drafted, prompts, mode, args.max_new_tokens, reference)
                    except Exception as exc:
                        row = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
                    rows.append(dict(config=label, gate="held open" if held_open else "on", **row))
                    print({k: v for k, v in rows[-1].items() if k != "token_ids"}, flush=True)
                    write_report(out, args, rows, len(prompts), final=False)
        drafted.close()

    write_report(out, args, rows, len(prompts))


if __name__ == "__main__":
    main()

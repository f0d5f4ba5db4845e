"""Forms of the exact kernels side by side: a decode step and verify passes, each form in processes of its own.

A form is what is fixed when a process starts: the llama.cpp build llama-cpp-python loads (LLAMA_CPP_LIB_PATH, e.g.
a library folder from scripts/build_llama_variant.sh) and ggml's environment (GGML_CPU_ROW_PAIRS=0 or 1: the
AVX-512 row pairs or the AVX2 multi-row kernels). Processes of the forms alternate (ABBA ...), so drift on the
machine hits every form alike. Each process loads the model with the default exact configuration, checks that
its kernels are batch-invariant on the positions it times, and takes the median of --passes timings of a decode
step and of a pass over each number of positions after a 200-token context. The table gives, per form, the
minimum and the median over its processes, and the verify cost in decode steps from the medians.

    .venv/bin/python scripts/kernel_forms.py --model qwen2.5-coder-1.5b --processes 8 \\
        --form "row pairs" GGML_CPU_ROW_PAIRS=1 --form "AVX2 kernels" GGML_CPU_ROW_PAIRS=0 \\
        --out docs/results/exactness/qwen2.5-coder-1.5b-zen4-forms
    .venv/bin/python scripts/kernel_forms.py --form native --form "AVX2 build" \\
        LLAMA_CPP_LIB_PATH="$(bash scripts/build_llama_variant.sh avx2)"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from llamacpp_exactness import PROMPT, decode_ms, verify_ms  # scripts/, beside this file

CONTEXT = 200  # tokens in the cache before each timed pass


def measure(model: str, positions: list[int], passes: int) -> dict:
    """One process's medians (ms): a decode step, and a pass over each number of positions."""
    from transformers import AutoTokenizer

    from mirrorsd.models import resolve_gguf
    from mirrorsd.runtime.backends import ggml_kernels
    from mirrorsd.runtime.backends.invariance import check_batch_invariance, greedy_tokens
    from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM

    gguf, tokenizer_dir = resolve_gguf(model)
    prompt = AutoTokenizer.from_pretrained(tokenizer_dir)(PROMPT)["input_ids"]
    lm = LlamaCppLM(gguf)
    tokens = greedy_tokens(lm, prompt, CONTEXT + max(*positions, passes) - len(prompt))
    invariance = check_batch_invariance(lm, tokens, offsets=(CONTEXT,), sizes=positions, chunks=(0,))
    result = {"row_pairs": ggml_kernels.row_pairs(), "build": ggml_kernels.build_id(),
              "max_abs_diff": invariance.max_abs_diff,
              "decode": decode_ms(lm, tokens, CONTEXT, passes),
              **{str(p): verify_ms(lm, tokens, CONTEXT, p - 1, passes) for p in positions}}
    lm.close()
    return result


def parse_forms(specs: list[list[str]]) -> dict[str, dict[str, str]]:
    """--form LABEL [VAR=VALUE ...] -> {label: environment}."""
    forms = {}
    for label, *assignments in specs:
        if any("=" not in a for a in assignments):
            raise SystemExit(f"--form {label!r}: settings are VAR=VALUE, got {assignments}")
        forms[label] = dict(a.split("=", 1) for a in assignments)
    if len(forms) < 2:
        raise SystemExit("give two forms or more (--form LABEL [VAR=VALUE ...])")
    return forms


def render(model: str, results: dict[str, list[dict]], positions: list[int], passes: int) -> str:
    keys = ["decode"] + [str(p) for p in positions]
    lines = [f"{model}: medians of {passes} timings a process after a {CONTEXT}-token context, "
             f"{len(next(iter(results.values())))} processes a form, alternating; ms as minimum / median over the "
             "processes; verify cost in decode steps from the medians.", "",
             "| form | setting | max \\|diff\\| batched vs one-token | decode step, ms | "
             + " | ".join(f"{p} positions, ms" for p in positions) + " | "
             + " / ".join(str(p) for p in positions) + " positions, decode steps |",
             "|" + "---|" * (5 + len(positions))]
    for label, runs in results.items():
        env = runs[0]["env"]
        setting = ", ".join(f"`{k}={Path(v).name if k == 'LLAMA_CPP_LIB_PATH' else v}`" for k, v in env.items())
        lowest = {k: min(r[k] for r in runs) for k in keys}
        median = {k: statistics.median(r[k] for r in runs) for k in keys}
        diff = max(r["max_abs_diff"] for r in runs)
        cells = [f"{lowest[k]:.1f} / {median[k]:.1f}" for k in keys]
        steps = " / ".join(f"{median[str(p)] / median['decode']:.2f}" for p in positions)
        lines.append(f"| {label} | {setting or 'as built'} | {'**0 (exact)**' if diff == 0 else f'{diff:.3g}'} | "
                     + " | ".join(cells) + f" | {steps} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name or .gguf file")
    ap.add_argument("--form", nargs="+", action="append", default=[], metavar=("LABEL", "VAR=VALUE"),
                    help="a form: its label and the environment its processes start with")
    ap.add_argument("--processes", type=int, default=8, help="processes a form")
    ap.add_argument("--passes", type=int, default=30, help="timings of each kind a process")
    ap.add_argument("--positions", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and table.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.positions, args.passes)))
        return
    forms = parse_forms(args.form)
    results: dict[str, list[dict]] = {label: [] for label in forms}
    order = list(forms)
    for i in range(args.processes):
        for label in order if i % 2 == 0 else order[::-1]:  # ABBA
            command = [sys.executable, __file__, "--child", "--model", args.model, "--passes", str(args.passes),
                       "--positions", *map(str, args.positions)]
            done = subprocess.run(command, env={**os.environ, **forms[label]}, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{label}: the measuring process failed:\n{done.stderr[-2000:]}")
            run = {**json.loads(done.stdout.strip().splitlines()[-1]), "env": forms[label]}
            results[label].append(run)
            print(f"{label} {i + 1}/{args.processes}: decode {run['decode']:.1f} ms, "
                  + ", ".join(f"{p} positions {run[str(p)]:.1f} ms" for p in args.positions)
                  + f", row pairs {run['row_pairs']}, build {run['build']}", flush=True)
    table = render(args.model, results, args.positions, args.passes)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"model": args.model, "results": results}, indent=1))
        (args.out / "table.md").write_text(table)


if __name__ == "__main__":
    main()

"""`mirrorsd draft-bench`: one draft model through torch and through ONNX Runtime exports, side by side.

For each backend (torch float32, and ONNX Runtime exports in fp32 / int8 / int4) it measures on the
same HumanEval prompts, in one run:

- draft tokens/s: greedy decoding one token at a time through the backend's KV cache (what a drafter
  does), `threads` threads for torch and for ONNX Runtime alike;
- the acceptance rate the draft achieves for the target: the target's greedy continuation of each
  prompt is computed once, then each backend drafts K tokens at every step of it and the step accepts
  the matching prefix (exactly what greedy speculative decoding with fixed K accepts), so every
  backend is scored on the same target tokens.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from mirrorsd.drafters import ModelDrafter
from mirrorsd.bench import AcceptanceCounts, greedy_continuation, replay_acceptance


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n HumanEval problems in the chat template, as `mirrorsd bench` asks them."""
    from mirrorsd.apps.bench.runner import chat, humaneval_prompts

    prompts = []
    for prompt in humaneval_prompts(n):
        ids = tokenizer.apply_chat_template(chat(prompt), add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def draft_speed(lm, prompts: list[list[int]], n: int) -> float:
    """Draft tokens/s: greedy decode steps (prefill of each prompt excluded)."""
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        lm.reset()
        lm.score(prompt)
        t0 = time.perf_counter()
        greedy_continuation(lm, prompt, n)
        seconds += time.perf_counter() - t0
        tokens += n
    return tokens / seconds


def acceptance(lm, prompts: list[list[int]], continuations: list[list[int]], k: int) -> tuple[float, float]:
    """(acceptance rate, mean accepted length incl. the target's token) against fixed target continuations."""
    counts = AcceptanceCounts()
    for prompt, cont in zip(prompts, continuations):
        lm.reset()
        replay_acceptance(ModelDrafter(lm), prompt, cont, k, counts)
    return counts.acceptance_rate or 0.0, counts.mean_accepted_length or 0.0


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def run_draft_bench(draft: str = "qwen2.5-coder-0.5b", target: str = "qwen2.5-coder-1.5b", n_prompts: int = 3,
                    max_new_tokens: int = 64, k: int = 4, threads: int = 1, exports: str | None = None,
                    variants: tuple[str, ...] = ("fp32", "int8", "int4"), max_context: int = 1024) -> str:
    from mirrorsd.exporters import export_draft, read_manifest
    from mirrorsd.backends import load_export_lm
    from mirrorsd.models import load_model
    from mirrorsd.drafters import exports_dir
    from mirrorsd.backends import TorchCausalLM

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    root = Path(exports) if exports else exports_dir() / f"bench-{draft}"
    draft_model, tokenizer = load_model(draft, cpu, torch.float32, progress=True)
    folders = {}
    for variant in variants:  # the dynamic profile: the CPU provider's form (int8 = dynamic int8)
        folder = root / f"dynamic-{variant}"
        if not (folder / "manifest.json").is_file():
            t0 = time.perf_counter()
            export_draft(draft_model, folder, profile="dynamic", quant="none" if variant == "fp32" else variant,
                         max_context=max_context, tokenizer=tokenizer, validate=False)
            print(f"exported {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
        folders[variant] = folder
    prompts = chat_prompts(tokenizer, n_prompts)
    target_model, target_tok = load_model(target, cpu, torch.float32, progress=True)
    from mirrorsd.tokenizer_check import check_tokenizers_match

    check_tokenizers_match(target_tok, tokenizer, target, draft)
    target_lm = TorchCausalLM(target_model)
    t0 = time.perf_counter()
    continuations = [greedy_continuation(target_lm, p, max_new_tokens) for p in prompts]
    target_tps = n_prompts * max_new_tokens / (time.perf_counter() - t0)
    del target_lm, target_model
    backends = {"torch float32": (TorchCausalLM(draft_model), None)}
    for variant, folder in folders.items():
        manifest = read_manifest(folder)
        form = "" if manifest["quant"] == "none" else f" ({manifest['quant_form']})"
        name = f"onnxruntime CPU {variant}{form}"
        backends[name] = (load_export_lm(folder, manifest, "cpu", threads=threads), folder)
    rows = []
    for name, (lm, folder) in backends.items():
        tps = draft_speed(lm, prompts, max_new_tokens)
        rate, mean_len = acceptance(lm, prompts, continuations, k)
        size = _size_mb(folder) if folder else sum(p.numel() * p.element_size() for p in draft_model.parameters()) / 2**20
        rows.append((name, tps, rate, mean_len, size))
        print(f"measured {name}: {tps:.2f} tok/s, acceptance {rate:.3f}", flush=True)
    base_tps, base_rate = rows[0][1], rows[0][2]
    lines = [
        f"draft {draft} for target {target}: greedy, {max_new_tokens} tokens, HumanEval 0-{n_prompts - 1} (chat "
        f"template), K={k} fixed; {threads} thread(s) for torch and ONNX Runtime alike; {platform.machine()}, "
        f"{platform.platform()}; torch {torch.__version__}, onnxruntime {_version('onnxruntime')}. "
        f"Target-only {target}: {target_tps:.2f} tok/s.",
        "",
        "| draft backend | draft tok/s | vs torch float32 | acceptance for the target | vs torch (points) "
        "| mean accepted length | weights MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, tps, rate, mean_len, size in rows:
        lines.append(f"| {name} | {tps:.2f} | {tps / base_tps:.2f}x | {rate:.3f} | "
                     f"{100 * (rate - base_rate):+.1f} | {mean_len:.2f} | {size:.1f} |")
    report = "\n".join(lines)
    print(report)
    return report


def _version(pkg: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"

"""Validation of an export against the PyTorch model it came from (`mirrorsd export --validate DIR`).

- fp32: logits within ATOL of PyTorch's on the CPU provider, for the prefill and decode paths;
- fp16 / quantized: top-1 agreement >= TOP1_MIN and greedy equality of a 64-token continuation;
  mean KL(torch || export) reported;
- for a draft export: the acceptance rate the export achieves as a draft for a target (by default the model it
  came from, so the rate measures what export and quantization cost; pass `target` for the real pair).
- Core ML: on macOS the same numbers through Core ML; elsewhere Core ML cannot predict, so the
  package's spec (inputs, states, outputs, shapes, precision) is checked and numerics are skipped.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mirrorsd.errors import ExportError

# Text the exports are calibrated and validated on: code, prose, chat, JSON (short, so it is fast).
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model",
    "import numpy as np\n\nfor i in range(10):\n    print(i * 2)\n",
    '{"name": "mirrorsd", "version": 1, "tokens": [1, 2, 3], "fast": true}',
]

ATOL = 5e-4
"""fp32 runtimes sum in different orders on different CPUs: the real smollm2-135m (30 layers) came within
1e-4 of PyTorch on an AMD EPYC and 1.4e-4 on an AVX-512 Xeon; a wrong graph is off by orders more."""
TOP1_MIN = 0.99
CONTINUATION = 64


@dataclass(frozen=True)
class Limits:
    """The pass thresholds (`mirrorsd export --atol / --min-top1`)."""

    atol: float = ATOL  # fp32 exports: largest |logit difference| from PyTorch
    top1_min: float = TOP1_MIN  # fp16 / quantized exports: least top-1 agreement with PyTorch


def _reference(manifest: dict, model, tokenizer):
    if model is not None and tokenizer is not None:
        return model.float().eval(), tokenizer
    from mirrorsd.errors import MirrorsdError
    from mirrorsd.models import load_model

    try:
        return load_model(manifest["model"], torch.device("cpu"), torch.float32)
    except MirrorsdError as exc:
        raise ExportError(f"cannot load {manifest['model']!r}, the model this export came from, to compare against",
                          "validate from Python with validate_export(DIR, model=..., tokenizer=...)") from exc


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    p = torch.log_softmax(torch.from_numpy(p_logits).double(), -1)
    q = torch.log_softmax(torch.from_numpy(q_logits).double(), -1)
    return (p.exp() * (p - q)).sum(-1).numpy()


def validate_export(folder: str | Path, model=None, tokenizer=None, target=None, provider: str = "cpu",
                    continuation: int = CONTINUATION, limits: Limits = Limits()) -> dict:
    """Compare an export with its PyTorch model; returns the report: report["passed"] says it all,
    report["checks"] says which check measured what against which threshold."""
    from mirrorsd.export_format import read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest["format"] == "coreml":
        from mirrorsd.exporters.coreml_export import check_coreml_spec

        spec = check_coreml_spec(folder, manifest)
        if platform.system() != "Darwin":
            check = _check("Core ML spec", "; ".join(spec["problems"]) or "as the manifest says",
                           "inputs, states, outputs as the manifest says", spec["ok"])
            return {"spec": spec, "passed": spec["ok"], "checks": [check],
                    "numerics": "skipped: Core ML runs predictions only on macOS (spec checked instead)"}
    model, tokenizer = _reference(manifest, model, tokenizer)
    from mirrorsd.runtime.backends.exported import load_export_lm

    lm = load_export_lm(folder, manifest, provider)
    diffs, top1, kls, greedy_equal = [], [], [], 0
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"][: manifest["max_context"] // 2]
        room = min(continuation, manifest["max_context"] - len(prompt) - 1)
        with torch.no_grad():
            ref_seq = model.generate(torch.tensor([prompt]), max_new_tokens=room, do_sample=False,
                                     min_new_tokens=room, pad_token_id=tokenizer.pad_token_id or 0)[0].tolist()
            ref = model(torch.tensor([ref_seq])).logits[0].float().numpy()  # [L, V]
        lm.reset()
        rows = [lm.score(prompt[:1], prompt[1:]).numpy()]  # prompt: the prefill path
        rows += [lm.score(ref_seq[: i + 1]).numpy() for i in range(len(prompt), len(ref_seq))]  # decode path
        got = np.concatenate(rows)[: len(ref_seq)]
        diffs.append(float(np.abs(got - ref).max()))
        top1.append(float((got.argmax(-1) == ref.argmax(-1)).mean()))
        kls.append(float(_kl(ref, got).mean()))
        lm.reset()
        context = list(prompt)
        for _ in range(room):
            context.append(int(lm.score(context)[-1].argmax()))
        greedy_equal += context == ref_seq
    exact = manifest["quant"] == "none" and manifest["precision"] == "fp32"
    report = {
        "provider": lm.backend, "prompts": len(PROMPTS), "continuation": continuation,
        "max_abs_logit_diff": max(diffs), "top1_agreement": float(np.mean(top1)), "mean_kl": float(np.mean(kls)),
        "greedy_equal": f"{greedy_equal}/{len(PROMPTS)}",
        "criteria": f"max |logit diff| <= {limits.atol:g}" if exact else f"top-1 >= {limits.top1_min:.0%} and greedy equal",
    }
    report["checks"] = _checks(report, exact, limits, greedy_equal == len(PROMPTS))
    report["passed"] = all(c["passed"] for c in report["checks"])
    if manifest.get("role", "draft") == "draft":  # a target export: no draft acceptance
        report["acceptance_rate"] = _acceptance(lm, manifest, target or model, tokenizer)
    return report


def _acceptance(lm, manifest: dict, target, tokenizer) -> float | None:
    """Greedy acceptance rate of the export drafting for `target` over the validation prompts (K = 4)."""
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
    from mirrorsd.runtime.drafters.model import ModelDrafter
    from mirrorsd.runtime.replay import AcceptanceCounts, greedy_continuation, replay_acceptance

    reference, drafter, counts = TorchCausalLM(target), ModelDrafter(lm), AcceptanceCounts()
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"][: manifest["max_context"] // 2]
        room = min(CONTINUATION, manifest["max_context"] - len(prompt) - 1)
        replay_acceptance(drafter, prompt, greedy_continuation(reference, prompt, room), 4, counts)
    return counts.acceptance_rate


def _check(name: str, measured, threshold: str, passed: bool) -> dict:
    return {"check": name, "measured": measured, "threshold": threshold, "passed": bool(passed)}


def _checks(report: dict, exact: bool, limits: Limits, greedy_equal: bool) -> list[dict]:
    """What passing means: fp32 matches PyTorch's logits; fp16 and quantized exports pick PyTorch's top-1
    token (they round the weights, so the logits move) and continue greedily alike."""
    if exact:
        diff = report["max_abs_logit_diff"]
        return [_check("max |logit diff|", diff, f"<= {limits.atol:g}", diff <= limits.atol)]
    top1 = report["top1_agreement"]
    return [_check("top-1 agreement", top1, f">= {limits.top1_min:g}", top1 >= limits.top1_min),
            _check("greedy equal", report["greedy_equal"], f"{report['prompts']}/{report['prompts']}", greedy_equal)]

"""Branch coverage: would a Mirror-SD correction branch have been prepared for each rejection?

Runs greedy speculative decoding (target + draft model, fixed K) on HumanEval chat prompts and collects
every rejection point: the prefix, the drafted tokens, the rejection position `pos` (the first draft
token the target's argmax disagreed with) and the correction (the target's argmax there). Then, for each
rejection and each target layer l, the LM head applied to the final-normed hidden state after layer l at
that position gives an early-exit distribution; coverage(l, kappa) is the share of rejections whose
correction is in its top-kappa. Row `pos` of the verify pass over prefix + draft depends only on
prefix + draft[:pos] (causal attention), so the hidden states are read from the verify pass itself (forward
hooks on every decoder layer, what the early-exit hook of torch_lm.py reads for one layer); the first
rejection is checked against a fresh `output_hidden_states=True` pass over prefix + draft[:pos].

The alternative branch source is the draft model's own distribution at the rejection position (the draft
runs anyway): its top-1 is the rejected token itself, so the table also gives its coverage with kappa
alternatives next to that token ("draft top-(1+kappa)").

    flock /tmp/mirrorsd-heavy.lock .venv/bin/python scripts/branch_coverage.py [--prompts 5] [--tokens 80]
        [--k 6] [--out docs/branch-coverage.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass

import torch

from mirrorsd.runtime.backends import load_lm

KAPPAS = (1, 3, 5, 10)
RANKS = max(KAPPAS) + 1  # ranks kept per rejection (draft: own token + 10 alternatives)


@dataclass
class Rejection:
    prefix: tuple[int, ...]  # the committed history when the step began
    drafted: tuple[int, ...]
    pos: int
    correction: int
    layer_rank: list[int]  # per layer 1..L: rank of the correction in the early-exit distribution (RANKS = beyond)
    draft_rank: int  # rank of the correction in the draft's distribution at pos


def rank_of(token: int, logits: torch.Tensor) -> int:
    """0-based rank of `token` among the top RANKS of `logits` [V]; RANKS when not among them."""
    top = torch.topk(logits, RANKS).indices.tolist()
    return top.index(token) if token in top else RANKS


class LayerTap:
    """Forward hooks on every decoder layer: the last `rows` hidden states of each pass (pre final norm)."""

    def __init__(self, model) -> None:
        self.rows = 0
        self.seen: list[torch.Tensor | None] = []
        layers = model.model.layers
        self.seen = [None] * len(layers)
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self.seen[i] = hidden[0, -self.rows:].detach()
        return hook


@torch.inference_mode()
def early_exit_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.get_output_embeddings()(model.model.norm(hidden)).float()


@torch.inference_mode()
def collect(target, draft, prompt_ids: list[int], max_new: int, k: int, eos: frozenset[int],
            tap: LayerTap) -> tuple[list[Rejection], int, int]:
    """Greedy speculative decoding of one prompt; returns its rejections, verify steps, generated tokens."""
    model = target.model
    n_layers = len(model.model.layers)
    committed = list(prompt_ids)
    rejections, steps, generated = [], 0, 0
    target.reset()
    draft.reset()
    while generated < max_new:
        kk = min(k, max_new - generated - 1)
        drafted, draft_logits = [], []
        for _ in range(kk):
            row = draft.score(committed + drafted)[0]  # [V]
            draft_logits.append(row)
            drafted.append(int(row.argmax()))
        tap.rows = len(drafted) + 1
        logits = target.score(committed, drafted)  # [k+1, V]
        steps += 1
        best = logits.argmax(-1).tolist()
        n_acc = next((i for i, (d, t) in enumerate(zip(drafted, best)) if d != t), len(drafted))
        new = drafted[:n_acc] + [best[n_acc]]
        if n_acc < len(drafted):
            correction = best[n_acc]
            ranks = [rank_of(correction, early_exit_logits(model, tap.seen[l][n_acc])) for l in range(n_layers - 1)]
            ranks.append(rank_of(correction, logits[n_acc]))  # layer L: the target itself (rank 0, greedy)
            rejections.append(Rejection(tuple(committed), tuple(drafted), n_acc, correction, ranks,
                                        rank_of(correction, draft_logits[n_acc])))
        committed += new
        generated += len(new)
        if any(t in eos for t in new):
            break
    return rejections, steps, generated


@torch.inference_mode()
def fresh_pass_rank(target, rej: Rejection, layer: int) -> int:
    """The correction's rank at `layer` in a fresh output_hidden_states=True pass over prefix + draft[:pos]
    (checks that the verify-pass hooks read the same thing)."""
    model = target.model
    ids = torch.tensor([list(rej.prefix) + list(rej.drafted[:rej.pos])])
    hs = model(ids, output_hidden_states=True).hidden_states
    return rank_of(rej.correction, early_exit_logits(model, hs[layer][0, -1]))


def coverage(ranks: list[int], kappa: int) -> float:
    return sum(r < kappa for r in ranks) / len(ranks) if ranks else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    args = ap.parse_args()

    from mirrorsd.apps.bench.prompt_suite import code_chat, humaneval_prompts
    from mirrorsd.chat_tokens import chat_ids

    start = time.perf_counter()
    t = load_lm(args.target, "torch")
    d = load_lm(args.draft, "torch")
    target, draft, tok = t.lm, d.lm, t.tokenizer
    tap = LayerTap(target.model)
    n_layers = len(target.model.model.layers)
    rejections: list[Rejection] = []
    steps = generated = 0
    checked = None
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = chat_ids(tok, code_chat(prompt))
        rej, s, g = collect(target, draft, ids, args.tokens, args.k, t.eos_ids, tap)
        if checked is None and rej:
            mid = n_layers // 2
            checked = (rej[0].layer_rank[mid - 1], fresh_pass_rank(target, rej[0], mid))
        rejections += rej
        steps, generated = steps + s, generated + g
        print(f"prompt {i}: {g} tokens, {s} verify steps, {len(rej)} rejections", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    for h in tap.handles:
        h.remove()

    lines = report(args, rejections, steps, generated, n_layers, checked, elapsed)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def report(args, rejections, steps, generated, n_layers, checked, elapsed) -> list[str]:
    ranks_by_layer = [[r.layer_rank[l] for r in rejections] for l in range(n_layers)]
    draft_ranks = [r.draft_rank for r in rejections]
    cmd = "flock /tmp/mirrorsd-heavy.lock .venv/bin/python " + " ".join(sys.argv)
    out = [
        "# Branch coverage: early exit vs the draft model",
        "",
        f"`{cmd}` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"float32 torch on the CPU; {elapsed:.0f} s)",
        "",
        f"target {args.target} ({n_layers} layers), draft {args.draft}, greedy, K={args.k}, first {args.prompts} "
        f"HumanEval problems as chat prompts, up to {args.tokens} new tokens each: {generated} tokens in {steps} "
        f"verify steps, {len(rejections)} rejections (steps where a drafted token was rejected).",
        "",
        "Coverage = share of rejections whose correction (the target's argmax at the rejection position) is in the "
        "top-kappa of the early-exit distribution at layer l (LM head on the final-normed hidden state after "
        "layer l, at that position).",
        "",
        "| layer l | " + " | ".join(f"kappa={k}" for k in KAPPAS) + " |",
        "|---|" + "---|" * len(KAPPAS),
    ]
    for l in range(n_layers):
        out.append(f"| {l + 1} | " + " | ".join(f"{coverage(ranks_by_layer[l], k):.2f}" for k in KAPPAS) + " |")
    out += [
        "",
        "The draft model's own distribution at the rejection position (its top-1 is the rejected token):",
        "",
        "| draft | " + " | ".join(f"kappa={k}" for k in KAPPAS) + " |",
        "|---|" + "---|" * len(KAPPAS),
        "| top-kappa | " + " | ".join(f"{coverage(draft_ranks, k):.2f}" for k in KAPPAS) + " |",
        "| top-(1+kappa): kappa alternatives | " + " | ".join(
            f"{coverage(draft_ranks, k + 1):.2f}" for k in KAPPAS) + " |",
        "",
        "Rejection positions (pos -> count): "
        + ", ".join(f"{p}: {sum(r.pos == p for r in rejections)}" for p in range(args.k)),
    ]
    if checked is not None:
        out.append(f"Check: at the middle layer, the first rejection's correction ranks {checked[0]} through the "
                   f"verify-pass hooks and {checked[1]} in a fresh output_hidden_states pass over prefix + "
                   f"draft[:pos] ({RANKS} = not in the top {RANKS - 1}).")
    return out


if __name__ == "__main__":
    main()

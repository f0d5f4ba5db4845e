"""Choosing devices: where the target model and the draft model run.

device="auto" picks CUDA, then Apple MPS, then the CPU; draft_device places an independent draft
model elsewhere (e.g. target on the GPU, draft on the CPU). Model-free drafters (n-gram, retrieval,
their chain) run on the host CPU and need no device.
"""

from __future__ import annotations

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.examples._args import parser
from mirrorsd.contracts import computes_on
from mirrorsd.devices import best_torch_device


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    p.add_argument("--draft-device", default=None, help="device for a draft model (default: --device)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    args = p.parse_args(argv)
    print(f"best device here: {best_torch_device()}")
    with Engine.load(target=args.target, draft=args.draft, device=args.device, draft_device=args.draft_device,
                     dtype=args.dtype) as engine:
        drafter = engine.drafter
        print(f"target on {engine.target.backend} (computes on the {engine.target.computes_on})")
        where = computes_on(drafter)
        print("drafter: " + ("none" if drafter is None else
                             f"{drafter.name} on the {where}" if where else f"{drafter.name} on the host CPU"))
        result = engine.generate("Hello", GenerationConfig(max_new_tokens=args.max_new_tokens))
        print(f"generated {len(result.token_ids)} tokens; steps served by {result.stats.drafters}")


if __name__ == "__main__":
    main()

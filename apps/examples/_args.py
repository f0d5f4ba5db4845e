"""The command-line options every example shares."""

from __future__ import annotations

import argparse


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default="smollm2-135m", help="catalog name, model folder or .gguf file")
    p.add_argument("--draft", default="auto", help="auto | ngram | chain | retrieval | none | a draft model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    return p

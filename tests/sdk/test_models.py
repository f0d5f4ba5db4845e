"""mirrorsd/models.py: load_tokenizer gives what AutoTokenizer gives, without importing transformers' index of
every model where the folder names the generic tokenizers backend (part of every command's start)."""

from __future__ import annotations

import json
import subprocess
import sys

from mirrorsd.models import load_tokenizer


def test_the_generic_backend_loads_as_autotokenizer_would(tiny_folder):
    from transformers import AutoTokenizer

    named = json.loads((tiny_folder / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert named in ("TokenizersBackend", "PreTrainedTokenizerFast")
    ours, auto = load_tokenizer(tiny_folder), AutoTokenizer.from_pretrained(tiny_folder)
    assert type(ours) is type(auto)
    for text in ("def quicksort(arr):\n", "Hello world! ünï 😀", "<eos><pad> x"):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    code = f"from mirrorsd.models import load_tokenizer; import sys; load_tokenizer({str(tiny_folder)!r}); " \
           "print('transformers.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_another_tokenizer_class_goes_through_autotokenizer(tiny_folder, tmp_path):
    import shutil

    folder = tmp_path / "named"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert type(load_tokenizer(folder)) is type(AutoTokenizer.from_pretrained(folder))

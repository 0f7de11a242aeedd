"""Byte tokenizer, ChatML template, and that the router can import both without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from belayer.errors import UsageError
from belayer_engine.model.chat_template import apply_chat_template
from belayer_engine.model.tokenizer import ByteTokenizer, load_tokenizer


def test_roundtrip_and_specials():
    tok = ByteTokenizer()
    text = "<|im_start|>user\nhé ✓<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 258 and 259 in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhé ✓\n"
    assert set(tok.eos_token_ids) == {257, 259}


def test_chat_template():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]}]
    assert apply_chat_template(msgs) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    cont = apply_chat_template([*msgs, {"role": "assistant", "content": "par"}],
                               add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\npar")
    with pytest.raises(UsageError):
        apply_chat_template([{"content": "no role"}])


def test_fallback_without_tokenizer_json(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_importable_without_torch():
    code = ("import sys; import belayer_engine, belayer_engine.model.chat_template, "
            "belayer_engine.model.tokenizer, belayer_engine.cli_args; "
            "belayer_engine.apply_chat_template([]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)

"""The tokenizer vocabularies the models carry: real ones, copied from llama.cpp's vocab-only GGUFs."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf

from .spec import VOCAB_DIR


def vocab_path(vocab: str) -> Path:
    """Path of the vocab-only GGUF ``ggml-vocab-<vocab>.gguf`` in the checkout's vendor tree."""
    path = VOCAB_DIR / f"ggml-vocab-{vocab}.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"vocab file {path} not found: run scripts/vendor_llama_cpp.py first")
    return path

@functools.lru_cache(maxsize=None)
def vocab_size(vocab: str) -> int:
    """Number of tokens in a vendored vocab file."""
    reader = gguf.GGUFReader(vocab_path(vocab))
    return len(reader.fields["tokenizer.ggml.tokens"].data)

def _copy_vocab(writer: gguf.GGUFWriter, vocab: str) -> None:
    """Copy every ``tokenizer.*`` key of a vendored vocab file, types unchanged."""
    reader = gguf.GGUFReader(vocab_path(vocab))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main_type = field.types[0]
        if main_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                # keep strings as raw bytes so the copy is byte-exact
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            writer.add_key_value(key, value, main_type, sub_type=sub_type)
        elif main_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main_type)
        else:
            writer.add_key_value(key, field.contents(), main_type)

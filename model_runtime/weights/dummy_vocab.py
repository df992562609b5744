"""The tokenizer of dummy shapes: byte-level, built in code, so a `dummy:` model needs no files at all.

    id    0..255   the byte of that value (text is encoded as its UTF-8 bytes, one token each)
    id    256      BOS_TOKEN (added by encode(add_special_tokens=True), written by the chat template)
    id    257      EOS_TOKEN
    ids   258..    nothing: decode() drops them

Dummy weights are random, so text in and out only has to round-trip, not mean anything. Benchmarks send random
token ids up to the shape's vocab_size (tandem_cli/bench/workload.py); validation bounds ids by the model's
vocab_size (ModelConfig), never by this tokenizer's, so those prompts are accepted and their text is empty.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from model_runtime.weights.gguf_vocab import bytes_to_unicode

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
NUM_BYTE_TOKENS = 256
# One turn per message, the role on its own line; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def byte_level_backend() -> BackendTokenizer:
    """256 byte tokens (id = byte value) with no merges, then BOS and EOS as special tokens (256, 257)."""
    spelling = bytes_to_unicode()  # the byte-level decoder expects GPT-2's printable spelling of each byte
    vocab = {spelling[b]: b for b in range(NUM_BYTE_TOKENS)}
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BOS_TOKEN, EOS_TOKEN)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 $B:1",
        special_tokens=[(BOS_TOKEN, NUM_BYTE_TOKENS)],
    )
    return backend

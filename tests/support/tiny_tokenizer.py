"""A tiny byte-level BPE tokenizer trained locally (no downloads), wrapped as a transformers fast tokenizer.

`tiny_tokenizer()` returns a fresh `PreTrainedTokenizerFast` (vocabulary of about 400 tokens) with ChatML-like
special tokens, pad/eos set and a small chat template; `tiny_tokenizer(chat_template=False)` has no template.
Training runs once per process (cached) and takes a few tens of milliseconds.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS_TURN, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 400

# Each message becomes `<|im_start|>ROLE\nCONTENT<|im_end|>\n`; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS_LINES = [
    "What is 12 + 7 * 3? The answer is 33.",
    "Janet has 16 eggs. She eats 3 and sells the rest for $2 each, so she makes 26 dollars.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Put the final answer in \\boxed{72}. #### 72",
    "system user assistant question answer total number of apples and oranges",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 - + * / = ( ) , . ? !",
    "the a an of to in is it that for on with as was by each how many much more less than",
]


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS_TURN, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS_LINES * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A fresh tiny tokenizer (safe to mutate). pad = `<|pad|>`, eos = `<|im_end|>`."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_json()),
        pad_token=PAD,
        eos_token=EOS,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE if chat_template else None
    return fast

"""A tiny byte-level BPE tokenizer trained locally with `tokenizers` (no downloads).

`train_tiny_tokenizer()` trains on a small built-in corpus shaped like the arithmetic dataset's prompts and
answers (digits, `+ - * /`, parentheses, `\\boxed{}`, a few English words) plus any extra texts, and wraps the
result as a `PreTrainedTokenizerFast` with ChatML special tokens and chat template:

- pad (and unk) `<|endoftext|>`, bos `<|im_start|>`, eos `<|im_end|>` (ids 0, 1, 2), as in Qwen; no special
  tokens are added on encode, the chat template writes them.
- Qwen-style pre-tokenization (NFC; digits split one by one), so that transformers' `Qwen2Tokenizer`, which
  `AutoTokenizer` picks for a qwen2 folder, encodes exactly like the saved `tokenizer.json`.
- each message renders as `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`; `add_generation_prompt=True` opens an
  assistant turn.

Byte-level: any text round-trips. Training is deterministic (same texts and size -> same vocabulary) and takes
a few tens of milliseconds.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
DEFAULT_VOCAB_SIZE = 512
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens
MAX_VOCAB_SIZE = 999  # tiny on purpose: vocabulary size dominates CPU cost

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "system user assistant What is the answer The answer is So Let me compute step by first then result "
    "Please reason step by step, and put your final answer within \\boxed{}. "
    "plus minus times divided by equals total number of apples and oranges each how many much more less than "
    "a an of to in it that for on with as was I we so"
)


def builtin_corpus(num_problems: int = 300, seed: int = 0) -> list[str]:
    """The built-in training texts: English lines plus arithmetic prompts/answers in the dataset's format."""
    rng = random.Random(seed)
    lines = [_WORDS, " ".join(str(n) for n in range(101)), "- + * / = ( ) , . ? ! : #### \\boxed{} { }"]
    for _ in range(num_problems):
        count = rng.randint(2, 4)
        values = [rng.randint(-20, 100) for _ in range(count)]
        ops = [rng.choice("+-*/") for _ in range(count - 1)]
        expression = f"({values[0]})" if values[0] < 0 else str(values[0])
        for op, value in zip(ops, values[1:], strict=True):
            expression += f" {op} " + (f"({value})" if value < 0 else str(value))
        answer = rng.randint(-500, 5000)
        lines.append(f"What is {expression}?")
        lines.append(f"{expression} = {answer}. The answer is \\boxed{{{answer}}}.")
    return lines


def _train(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as transformers' Qwen2Tokenizer, which `AutoTokenizer` rebuilds
    # for a qwen2 model folder from the vocab and merges: both archs then encode identically.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tiny_tokenizer(
    texts: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus plus `texts`; at most `vocab_size` tokens (< 1000)."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")
    corpus = builtin_corpus() + [str(text) for text in (texts or ())]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train(corpus, vocab_size),
        pad_token=PAD,
        unk_token=PAD,  # never produced by a byte-level BPE; set so every loader agrees
        bos_token=BOS,
        eos_token=EOS,
        padding_side="right",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast

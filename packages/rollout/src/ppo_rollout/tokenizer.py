"""A character-level Hugging Face tokenizer for the built-in tasks.

One token per character, built with the ``tokenizers`` library (a ``WordLevel`` model over single
characters) and wrapped in ``PreTrainedTokenizerFast``, so ``AutoTokenizer.from_pretrained`` loads
it from the model folder like any other tokenizer. A tiny vocabulary keeps a tiny model learnable.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Digits and the few separators the built-in tasks use.
DEFAULT_ALPHABET: str = "0123456789>=+-: "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A tokenizer with ids 0-3 for ``<pad> <bos> <eos> <unk>``, then one id per character of ``alphabet``.

    Encoding prepends ``<bos>`` (``add_special_tokens=True``); decoding joins characters without spaces.
    """
    chars = list(dict.fromkeys(alphabet))
    if len(chars) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}; give each character once")
    if any(len(c) != 1 for c in chars) or not chars:
        raise ValueError("alphabet must be a non-empty string of single characters")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token (Oniguruma: "(?m)" lets "." match newlines).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )

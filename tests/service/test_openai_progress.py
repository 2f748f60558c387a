"""The text a streamed answer shows while its decode runs: only as far as more tokens cannot change it."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from icefloe.service.openai.sampling import _settled_text


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with one token per byte (GPT-2's byte alphabet, no merges): a character
    of several bytes takes several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_settled_text_holds_back_a_character_split_across_tokens(byte_tokenizer):
    ids = byte_tokenizer.encode("né€")
    assert len(ids) == 1 + 2 + 3
    shown = [_settled_text(byte_tokenizer, ids[:k], ()) for k in range(len(ids) + 1)]
    assert shown == ["", "n", "n", "né", "né", "né", "né€"]


def test_settled_text_holds_back_what_could_become_a_stop_string_and_cuts_at_one(byte_tokenizer):
    ids = byte_tokenizer.encode("say END now")
    shown = [_settled_text(byte_tokenizer, ids[:k], ("END",)) for k in range(len(ids) + 1)]
    assert shown[4:9] == ["say ", "say ", "say ", "say ", "say "]  # "E", "EN" held; "END" cut
    assert shown[-1] == "say "
    assert _settled_text(byte_tokenizer, byte_tokenizer.encode("say EX"), ("END",)) == "say EX"


@pytest.mark.parametrize(
    ("text", "stop", "held"),
    [
        ("say E", "END", 1),
        ("say EN", "END", 2),
        ("say EX", "END", 0),
        ("abab", "ababc", 4),  # the longest ending wins over the shorter "ab"
        ("xabab", "abac", 2),  # "abab" does not begin "abac"; "ab" does
        ("aaaa", "aaaaaaaaa", 4),  # the whole text may be held
        ("", "END", 0),
    ],
)
def test_held_back_is_the_longest_ending_that_begins_a_stop_string(text, stop, held):
    from icefloe.service.openai.sampling import _held_for

    brute = max((k for k in range(1, len(stop)) if k <= len(text) and text.endswith(stop[:k])), default=0)
    assert _held_for(text, stop) == brute == held

"""The bounds a body meets before it is parsed (``service/limits.py``)."""

from __future__ import annotations

import struct

import pytest

from icefloe.protocol import PayloadTooLargeError
from icefloe.service.limits import check_containers, check_frame_header, truncated


def test_check_containers_counts_before_parsing_and_ignores_brackets_inside_strings():
    check_containers(b"[" + b",".join([b"[1]"] * 10) + b"]", "body", limit=11)
    with pytest.raises(PayloadTooLargeError, match="body holds 12 JSON arrays and objects; at most 11"):
        check_containers(b"[" + b",".join([b"[1]"] * 11) + b"]", "body", limit=11)
    check_containers(b'["[[[[{{{{", "\\"[[[["]', "body", limit=1)  # text, not containers


def test_a_frame_header_is_refused_from_its_declared_length_and_from_the_tree_inside_its_string():
    with pytest.raises(PayloadTooLargeError, match="declares a 67108864-byte header"):
        check_frame_header(struct.pack("<Q", 64 * 2**20))
    tree = b'{"__metadata__":{"dss":"' + b"[" * 70_000 + b'"}}'
    with pytest.raises(PayloadTooLargeError, match="the DSSST1 frame's header holds 70002"):
        check_frame_header(struct.pack("<Q", len(tree)) + tree)


def test_truncated_names_ten_problems_then_counts_the_rest():
    assert truncated(f"p{i}" for i in range(3)) == "p0; p1; p2"
    assert truncated(f"p{i}" for i in range(100_000)) == "; ".join(f"p{i}" for i in range(10)) + "; ... and 99990 more"


def test_a_frame_header_of_many_strings_in_its_tree_is_refused_before_it_is_parsed():
    """16 MiB of "ab" strings in a tree's plain values became a Python str each (about 50 bytes for 8)."""
    tree = b'{"__metadata__":{"dss":"' + b",".join([b'\\"ab\\"'] * 70_000) + b'"}}'
    with pytest.raises(PayloadTooLargeError, match="the DSSST1 frame's header holds 70003 JSON strings; at most 65536"):
        check_frame_header(struct.pack("<Q", len(tree)) + tree)


def test_a_frame_header_of_many_loose_values_is_refused_but_not_one_of_token_arrays():
    """Floats with one string among them are no array of plain numbers: each was a Python float (32 bytes for
    the 4 of "1.5,"). Arrays of token ids, however long, are read as machine numbers and pass."""
    loose = b'{"__metadata__":{"dss":"[' + b",".join([b"1.5"] * 200_000) + b',\\"x\\"]"}}'
    with pytest.raises(PayloadTooLargeError, match="200000 JSON values outside arrays of plain numbers; at most"):
        check_frame_header(struct.pack("<Q", len(loose)) + loose)
    prompts = b",".join([b"[" + b",".join([b"12345"] * 2000) + b"]"] * 512)
    tokens = b'{"__metadata__":{"dss":"[' + prompts + b']"}}'
    check_frame_header(struct.pack("<Q", len(tokens)) + tokens)

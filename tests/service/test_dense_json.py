"""A large JSON body's arrays of numbers read as machine numbers (``wire/dense_json.py``), and the
checks that read them: non-finite numbers, generate prompts, Tinker token ids."""

from __future__ import annotations

import array
import json
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icefloe.protocol import InvalidRequestError
from icefloe.service.limits import CHECK_ON_LOOP_BYTES
from icefloe.service.schemas import GenerateBody, JobCreate, parse_json_body
from icefloe.service.tinker.checks import int_array
from icefloe.wire.dense_json import as_lists, loads

_PAD = b" " * (CHECK_ON_LOOP_BYTES + 1)  # whitespace makes any document a large body


def _large(text: str | bytes) -> bytes:
    return (text.encode() if isinstance(text, str) else text) + _PAD


def _same(got, wanted) -> bool:
    """``got`` (arrays turned back into lists) equals ``wanted``, NaN equal to NaN, an int equal to its float."""
    got = as_lists(got)
    if isinstance(wanted, dict):
        return isinstance(got, dict) and got.keys() == wanted.keys() and all(_same(got[k], wanted[k]) for k in wanted)
    if isinstance(wanted, list):
        return isinstance(got, list) and len(got) == len(wanted) and all(map(_same, got, wanted))
    if isinstance(wanted, float) and math.isnan(wanted):
        return isinstance(got, float) and math.isnan(got)
    return got == wanted and (type(got) is type(wanted) or isinstance(wanted, float) or isinstance(got, float))


def test_arrays_of_integers_become_the_narrowest_integer_arrays_that_hold_them():
    body = loads(
        _large('{"b": [1, -128], "h": [300, 1], "i": [2147483647], "q": [-2147483649, 7], "t": [1, 2, 12345678901]}')
    )
    assert [body[key].typecode for key in "bhiqt"] == ["b", "h", "i", "q", "q"]
    assert body["t"] == array.array("q", [1, 2, 12345678901]) and body["q"] == array.array("q", [-2147483649, 7])
    wide = loads(_large("[" + "1," * 40_000 + "40000]"))  # past the first slice: what was read is copied wider
    assert wide.typecode == "i" and list(wide) == [1] * 40_000 + [40000]


def test_arrays_with_fractions_or_exponents_become_float_arrays_holding_the_same_doubles():
    values = [0.1, -2.5e-300, 1.7976931348623157e308, 5e-324, 1e22, -0.0]
    body = loads(_large(json.dumps({"x": values, "e": [1e3, 2.5e-1, 3e1]})))
    assert body["x"].typecode == "d" and list(body["x"]) == values and body["e"].typecode == "f"
    assert list(body["e"]) == [1000.0, 0.25, 30.0]


def test_a_float_array_is_float32_while_float32_holds_each_number_exactly():
    body = loads(_large("[" + "1," * 1000 + "0.5, NaN, -Infinity]"))
    assert body.typecode == "f" and list(body)[:1001] == [1.0] * 1000 + [0.5] and math.isnan(body[-2])
    body = loads(_large("[" + "1," * 20_000 + "0.1, 1e39]"))  # past the first slice: what was read is copied wider
    assert body.typecode == "d" and list(body)[-3:] == [1.0, 0.1, 1e39]


def test_an_integer_a_double_cannot_hold_leaves_a_float_array_a_list():
    assert loads(_large("[0.5, 9007199254740993]")) == [0.5, 9007199254740993]
    assert loads(_large("[0.5, 9007199254740992]")) == array.array("d", [0.5, 2.0**53])


def test_nan_and_infinity_are_read_as_json_reads_them_and_refused_naming_the_field():
    body = loads(_large('{"x": [1.5, NaN, Infinity, -Infinity]}'))
    assert math.isnan(body["x"][1]) and body["x"][2:] == array.array("d", [math.inf, -math.inf])
    with pytest.raises(InvalidRequestError, match=r"holds non-finite numbers: x\.1=nan, x\.2=inf, x\.3=-inf;"):
        parse_json_body(_large('{"x": [1.5, NaN, Infinity, -Infinity]}'))
    with pytest.raises(InvalidRequestError, match=r"data\.0\.w\.2=inf"):
        parse_json_body(_large('{"data": [{"w": [1, 2, 1e400]}]}'))  # overflows a double, as json reads it
    with pytest.raises(InvalidRequestError, match=r"x\.0=nan, .*x\.9=nan and 990 more;"):
        parse_json_body(_large('{"x": [' + ",".join(["NaN"] * 1000) + "]}"))


def test_nested_empty_and_mixed_arrays_and_numbers_inside_strings():
    body = loads(_large('{"t": [[1, 2], [3], []], "s": "[1, 2] \\" [3]", "m": [1, "a"], "e": [ ], "b": [true]}'))
    assert body["t"] == [array.array("b", [1, 2]), array.array("b", [3]), []]
    assert body["s"] == '[1, 2] " [3]' and body["m"] == [1, "a"] and body["e"] == [] and body["b"] == [True]


def test_whitespace_anywhere_json_allows_it():
    assert loads(_large(b"[\n\t 1 ,\r\n 2\t,3 ]")) == array.array("b", [1, 2, 3])


def test_an_integer_beyond_int64_leaves_its_array_a_list_of_python_ints():
    body = loads(_large('{"x": [1, 123456789012345678901234567890], "y": [9223372036854775808]}'))
    assert body == {"x": [1, 123456789012345678901234567890], "y": [9223372036854775808]}


def test_a_small_body_is_read_by_json_alone():
    assert loads('{"x": [1, 2.5]}') == {"x": [1, 2.5]}


def test_a_client_string_cannot_pass_for_a_placeholder():
    body = loads(_large('{"a": [1, 2], "b": "0:0", "c": ":0"}'))
    assert body == {"a": array.array("b", [1, 2]), "b": "0:0", "c": ":0"}


@pytest.mark.parametrize(
    "text", ['{"a": [1, 2,]}', '{"a": [01]}', '{"a": [1.]}', '{"a": [.5]}', '{"a": [+1]}', '{"a": [1 2]}',
             '{"a": [-]}', '{"a": [nan]}', '{"a": [1] "b": 2}', '[1, 2] x', '{"a": [1e5e5]}'],
)  # fmt: skip
def test_invalid_json_fails_as_json_loads_fails_at_the_same_place(text):
    with pytest.raises(json.JSONDecodeError) as ours:
        loads(_large(text))
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(_large(text))
    assert (ours.value.msg, ours.value.pos) == (theirs.value.msg, theirs.value.pos)


_NUMBER = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -0.0, 1e300, 2**31, -(2**31) - 1, 2**63 - 1]),
)
_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), _NUMBER, st.text(max_size=5), st.lists(_NUMBER, max_size=6)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(document=_JSON, spaced=st.booleans())
def test_any_document_reads_as_json_loads_reads_it(document, spaced):
    text = json.dumps(document, indent=1 if spaced else None)
    assert _same(loads(_large(text)), json.loads(text))


@pytest.mark.parametrize(("item", "per_number"), [(b"1", 2), (b"0.5", 4), (b"31999", 6), (b"-1.25e-7", 9)])
def test_a_4_mib_array_of_numbers_is_held_in_twice_its_size(item, per_number):
    """``json.loads`` held 30 to 40 MiB for these; the array is at most twice the text while it is read."""
    body = b'{"x": [' + b",".join([item] * (4 * 2**20 // per_number)) + b"]}"
    tracemalloc.start()
    try:
        kept = loads(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kept["x"].itemsize * len(kept["x"]) <= 2 * len(body)
    assert peak <= 2.5 * len(body)


def test_generate_prompts_of_a_large_body_stay_arrays_and_integral_floats_pass_as_ints():
    prompts = parse_json_body(_large('{"prompts": [[1, 2, 3], "text", [4.0, 5.0]]}'))["prompts"]
    body = GenerateBody.model_validate({"prompts": prompts})
    assert body.prompts[0] == array.array("b", [1, 2, 3]) and body.prompts[1] == "text"
    assert body.prompts[2] == array.array("q", [4, 5])
    with pytest.raises(ValueError, match=r"prompts\.0\n.*token ids are integers; got 1.5 at position 1"):
        GenerateBody.model_validate({"prompts": [array.array("d", [1.0, 1.5])]})


def test_a_large_create_job_body_keeps_its_number_arrays_as_the_lists_it_stores():
    config = {"job_type": "training", "model_name": "tiny:arith", "capture_sizes": [1, 2, 4], "scale": [0.5, 2]}
    body = parse_json_body(_large(json.dumps({"sub_job_configs": [config]})))
    assert type(body["sub_job_configs"][0]["capture_sizes"]) is array.array
    created = JobCreate.model_validate(body)
    assert created.model_dump(mode="json")["sub_job_configs"][0]["capture_sizes"] == [1, 2, 4]
    assert created.sub_job_configs[0].model_extra == {"capture_sizes": [1, 2, 4], "scale": [0.5, 2.0]}


def test_tinker_token_ids_are_read_from_lists_or_arrays_and_range_checked():
    assert int_array([1, 2], "t", "ids", low=0, high=2**31).tolist() == [1, 2]
    assert int_array(array.array("q", [3]), "t", "ids", low=0, high=2**31).tolist() == [3]
    assert int_array([], "t", "ids", low=0, high=2**31).dtype == np.int64
    for bad in ([1, 2.0], [True], [-1], [2**31], array.array("q", [2**31]), array.array("i", [-1]),
                array.array("d", [1.0]), "12", [[1]]):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="t must be ids"):
            int_array(bad, "t", "ids", low=0, high=2**31)


def test_numbers_no_machine_type_holds_are_read_exactly_but_only_so_many():
    """An integer of 2**53 or more among fractions keeps its array a list of Python numbers, exact; 524k such
    floats (a 2 MiB body) cost 8 times their text, so past a bound the document is refused."""
    few = b'{"a": [' + b",".join([b"1.5"] * 20_000) + b", 9007199254740993]}"
    assert loads(few)["a"][-1] == 9007199254740993
    many = b'{"a": [' + b",".join([b"1.5"] * 200_000) + b", 9007199254740993]}"
    with pytest.raises(json.JSONDecodeError, match="more than 131072 numbers in arrays that no machine type holds"):
        loads(many)

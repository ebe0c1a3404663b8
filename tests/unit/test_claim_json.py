"""The claim decodes payloads and headers with the JSON scanner alone
(`pgq.store.claims._loads`): every value and every error is `json.loads`'s, so an
unreadable stored message is claimed `unreadable` as before."""

from __future__ import annotations

import json
import re

import pytest

from pgq.store.claims import _loads

TEXTS = [
    *('{"i": 1}', "[1, 2.5, null, true]", '"\\u00e9\\ud83d\\ude00"', "-0", "1e400", "NaN"),
    *(' {"a": 1} ', '{"a": 1}x', '{"a": 1} {"b": 2}', "", "{", "\ufeff1", "[1,]"),
]


@pytest.mark.parametrize("text", TEXTS)
def test_claimed_json_decodes_as_json_loads_does(text):
    try:
        expected: object = json.loads(text)
    except ValueError as exc:
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            _loads(text)
        return
    got = _loads(text)
    assert type(got) is type(expected)
    assert got == expected or (got != got and expected != expected)  # NaN


def test_a_payload_nested_too_deep_raises_as_json_loads_does():
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    with pytest.raises(RecursionError):
        json.loads(deep)
    with pytest.raises(RecursionError):
        _loads(deep)

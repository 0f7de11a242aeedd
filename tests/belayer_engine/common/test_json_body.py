"""The request bodies the router sends a worker: the same JSON with orjson or without it."""

import json

import pytest

from belayer_engine.common import json_body
from belayer_engine.common.json_body import encode_json

BODY = {"input_ids": list(range(0, 150_000, 37)), "sampling_params": {"max_new_tokens": 48, "temperature": 0.0},
        "stream": True, "rid": "r-1", "text": "naïve \u2028 \"quoted\""}


@pytest.mark.parametrize("with_orjson", [True, False])
def test_the_encoded_body_parses_back_to_the_same_object(monkeypatch, with_orjson):
    if not with_orjson:
        monkeypatch.setattr(json_body, "_orjson", None)
    elif json_body._orjson is None:
        pytest.skip("orjson is not installed")
    raw = encode_json(BODY)
    assert isinstance(raw, bytes)
    assert json.loads(raw) == BODY


def test_a_value_json_cannot_hold_is_refused_in_both_encoders(monkeypatch):
    with pytest.raises(TypeError):
        encode_json({"ids": {1, 2}})
    monkeypatch.setattr(json_body, "_orjson", None)
    with pytest.raises(TypeError):
        encode_json({"ids": {1, 2}})

"""kvrun.cli.server_fields: a request body checked field by field before anything runs;
each wrong value is an ApiError 400 naming its parameter (the same through a real server:
test_serve_hostile.py)."""
import json

import pytest

from kvrun.cli.server_fields import (MAX_DEPTH, ApiError, check_fields, field, logprobs_from,
                                     max_tokens_from, n_from, parse_body, sampling_from,
                                     stop_from, stream_from)


def _refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


def test_parse_body():
    assert parse_body(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    for raw, why in ((b"[1]", "must be a JSON object"), (b"{", "malformed JSON body"),
                     (b'{"x": NaN}', "NaN is not a JSON value"),
                     (b'{"x": "\\ud800"}', "not valid Unicode"),
                     (b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1),
                      f"nested deeper than {MAX_DEPTH} levels")):
        assert why in _refused(parse_body, raw).message
    err = ApiError(404, "x" * 1000, "not_found_error", param="model", code="c")
    assert len(err.message) == 400 and err.message.endswith("...")
    assert err.body() == {"error": {"message": err.message, "type": "not_found_error",
                                    "param": "model", "code": "c"}}
    assert json.loads(err.response().body) == err.body() and err.response().status_code == 404


def test_check_fields_knows_each_endpoints_names():
    check_fields({"messages": [], "user": "u", "frequency_penalty": 0.0, "echo": None}, chat=True)
    check_fields({"prompt": "x", "echo": False, "logit_bias": {}}, chat=False)
    e = _refused(check_fields, {"frequency_penalty": 0.5}, True)
    assert (e.param, e.code) == ("frequency_penalty", "unsupported_parameter")
    assert _refused(check_fields, {"echo": 0}, True).param == "echo"        # false is not 0
    assert _refused(check_fields, {"prompt": "x"}, True).code == "unknown_parameter"
    assert _refused(check_fields, {"user": 5}, True).param == "user"


def test_field_types():
    assert field({"a": 2}, "a", (int, float)) == 2 and field({}, "a", int, 7) == 7
    assert _refused(field, {"a": True}, "a", int).message == "'a' must be an integer, got true"
    assert _refused(field, {"a": "1"}, "a", (int, float)).message == \
        "'a' must be an integer or a number, got \"1\""


def test_sampling_and_counts():
    p = sampling_from({"temperature": 0, "top_k": 5, "seed": 3})
    assert (p.temp, p.top_p, p.top_k, p.seed) == (0.0, 1.0, 5, 3)
    e = _refused(sampling_from, {"top_p": 1.5})
    assert e.param == "top_p" and e.message.startswith("'top_p' ")
    assert max_tokens_from({"max_tokens": 5, "max_completion_tokens": 5}, True) == 5
    assert max_tokens_from({"max_completion_tokens": 9}, False) is None    # chat's name only
    assert _refused(max_tokens_from, {"max_tokens": 4, "max_completion_tokens": 5}, True).param \
        == "max_completion_tokens"
    assert _refused(max_tokens_from, {"max_tokens": -1}, False).param == "max_tokens"
    assert n_from({}, 4, None) == 1 and n_from({"n": 4}, 4, None) == 4
    assert "[1, 4]" in _refused(n_from, {"n": 5}, 4, None).message
    assert _refused(n_from, {"n": 2}, 4, (1 << 64) - 1).param == "seed"


def test_stop_logprobs_and_stream():
    assert stop_from({"stop": "END"}) == ["END"] and stop_from({}) is None
    for bad in ("", [""], [1], {"a": 1}):
        assert _refused(stop_from, {"stop": bad}).param == "stop"
    assert logprobs_from({"logprobs": True, "top_logprobs": 3}, True) == 3
    assert logprobs_from({"logprobs": False}, True) is None
    assert _refused(logprobs_from, {"top_logprobs": 2}, True).param == "top_logprobs"
    assert logprobs_from({"logprobs": 2}, False) == 2 and logprobs_from({"logprobs": False}, False) is None
    assert _refused(logprobs_from, {"logprobs": 6}, False).param == "logprobs"
    assert stream_from({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert stream_from({}) == (False, False)
    assert _refused(stream_from, {"stream_options": {"include_usage": True}}).param == "stream_options"
    assert _refused(stream_from, {"stream": True, "stream_options": {"x": 1}}).param == "stream_options"

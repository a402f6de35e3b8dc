"""The decode worker's codec: wire sampling params reach the engine as the engine's own."""

from __future__ import annotations

import pytest

from baton.v1 import common_pb2
from baton_decode.codec import sampling_params_from_proto
from baton_engine.errors import InvalidRequestError


def test_bad_words_arrive_as_token_id_sequences() -> None:
    """The gateway's tokenized bad words survive the wire in order; none sent means none; an
    empty sequence is refused as the engine refuses it."""
    sent = common_pb2.SamplingParams(
        temperature=0.5,
        bad_words=[common_pb2.TokenIds(token_ids=[5, 6, 7]), common_pb2.TokenIds(token_ids=[9])],
    )
    received = common_pb2.SamplingParams.FromString(sent.SerializeToString())
    params = sampling_params_from_proto(received)
    assert params.bad_words_token_ids == [[5, 6, 7], [9]]
    assert params.bad_words is None  # the words stay with the gateway
    assert sampling_params_from_proto(common_pb2.SamplingParams()).bad_words_token_ids is None
    empty = common_pb2.SamplingParams(bad_words=[common_pb2.TokenIds(token_ids=[])])
    with pytest.raises(InvalidRequestError, match="empty sequence"):
        sampling_params_from_proto(empty)


def test_extra_args_arrive_as_the_object_sent() -> None:
    """vLLM's ``extra_args`` (the gateway's ``vllm_xargs``) come as JSON text: the object
    reaches the engine; none sent means None; text that is not a JSON object is refused."""
    sent = common_pb2.SamplingParams(extra_args='{"target_token": 5, "tags": ["a", 1.5]}')
    params = sampling_params_from_proto(sent)
    assert params.extra_args == {"target_token": 5, "tags": ["a", 1.5]}
    assert sampling_params_from_proto(common_pb2.SamplingParams()).extra_args is None
    for text, message in (("{", "not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(InvalidRequestError, match=message):
            sampling_params_from_proto(common_pb2.SamplingParams(extra_args=text))

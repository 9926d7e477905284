"""External backends' config (gateway/backends/backend_spec.py, `backends:` in gateway/config.py), the wire
translation to vLLM (gateway/backends/backend_wire.py) and the /metrics reading (gateway/backends/backend_load.py)."""

from __future__ import annotations

import json

import pytest

from duet.rpc import engine_pb2 as pb
from gateway.backends.backend_load import engine_load
from gateway.backends.backend_spec import BackendSpecError, parse_backend_flag, parse_backends
from gateway.backends.backend_wire import ChunkReader, WireError, completions_body, vllm_generate_body
from gateway.config import ConfigError, from_dict


def test_vllm_defaults_to_paged_sglang_to_prefix():
    specs = parse_backends([{"engine": "vllm", "url": "http://h:8000/"},
                            {"engine": "sglang", "url": "http://h:30000", "kv_events": "tcp://h:5557"}])
    assert [(s.engine, s.kind, s.url) for s in specs] == [("vllm", "paged", "http://h:8000"),
                                                          ("sglang", "prefix", "http://h:30000")]
    assert specs[1].kv_events.endpoint == "tcp://h:5557" and specs[0].block_size == 128


def test_config_file_form():
    cfg = from_dict({"backends": [{"engine": "vllm", "url": "http://10.0.0.7:8000", "kind": "prefix",
                                   "kv_events": {"endpoint": "tcp://10.0.0.7:5557",
                                                 "replay_endpoint": "tcp://10.0.0.7:5558"}}]})
    (b,) = cfg.backends
    assert b.kind == "prefix" and b.kv_events.replay_endpoint == "tcp://10.0.0.7:5558"


@pytest.mark.parametrize("entry, says", [
    ({"engine": "tgi", "url": "http://h:1"}, "'engine' must be one of"),
    ({"engine": "vllm", "url": "h:8000"}, "http(s)://HOST:PORT"),
    ({"engine": "vllm", "url": "http://h"}, "http(s)://HOST:PORT"),
    ({"engine": "vllm", "url": "http://h:1", "kind": "sim"}, "'kind' must be 'paged' or 'prefix'"),
    ({"engine": "vllm", "url": "http://h:1", "block_size": 0}, "'block_size' must be a positive integer"),
    ({"engine": "vllm", "url": "http://h:1", "kv_events": {"endpoint": "h:5557"}}, "tcp://HOST:PORT"),
    ({"engine": "vllm", "url": "http://h:1", "kv_event": "tcp://h:1"}, "unknown keys"),
    ("http://h:1", "must be a mapping"),
])
def test_bad_entries_are_refused_naming_the_field(entry, says):
    with pytest.raises(ConfigError, match="backends\\[0\\]") as err:
        from_dict({"backends": [entry]})
    assert says in str(err.value)


def test_a_backend_listed_twice_is_refused():
    with pytest.raises(ConfigError, match="listed twice"):
        from_dict({"backends": [{"url": "http://h:1"}, {"url": "http://h:1/"}]})


def test_duet_up_flag():
    assert parse_backend_flag("paged=http://127.0.0.1:8100") == {"engine": "vllm", "url": "http://127.0.0.1:8100",
                                                                 "kind": "paged"}
    assert parse_backend_flag("sglang:prefix=http://h:30000")["engine"] == "sglang"
    with pytest.raises(BackendSpecError, match="KIND=URL"):
        parse_backend_flag("http://127.0.0.1:8100")
    with pytest.raises(BackendSpecError, match="'kind'"):
        parse_backend_flag("decode=http://h:1")


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], cache_salt="tenant",
                              sampling=pb.SamplingParams(max_tokens=8, **sampling))


def test_vllm_body_carries_duets_sampling():
    body = vllm_generate_body(_request(temperature=0.5, n=2, logprobs=3, seed=2**64 - 1, json_schema='{"type":"object"}',
                                       stop_token_ids=[7], logit_bias={5: -100.0}))
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2, 3] and body["cache_salt"] == "tenant" and body["stream"] is True
    assert "priority" not in body  # vLLM refuses a priority unless it schedules by priority
    assert sp["temperature"] == 0.5 and sp["n"] == 2 and sp["logprobs"] == 3 and sp["seed"] < 2**63
    assert sp["structured_outputs"] == {"json": '{"type":"object"}'} and sp["stop_token_ids"] == [7]
    assert sp["logit_bias"] == {"5": -100.0} and "top_k" not in sp  # unset stays vLLM's default


def test_greedy_n_becomes_top_k_1():
    """vLLM refuses n > 1 at temperature 0; Duet's engines do not, so the gateway asks for the argmax another way."""
    sp = vllm_generate_body(_request(temperature=0.0, n=2))["sampling_params"]
    assert (sp["temperature"], sp["top_k"], sp["n"]) == (1.0, 1, 2)


def test_what_backends_cannot_serve_is_invalid():
    with pytest.raises(WireError, match="beam search") as err:
        vllm_generate_body(_request(beam_width=4))
    assert not err.value.retryable
    with pytest.raises(WireError, match="prompt_logprobs"):
        completions_body(_request(prompt_logprobs=1), "m")


def test_openai_body_is_a_token_id_prompt():
    body = completions_body(_request(json_object=True), "served")
    assert body["prompt"] == [1, 2, 3] and body["model"] == "served"
    assert body["response_format"] == {"type": "json_object"} and "structured_outputs" not in body


def test_chunks_become_messages_with_the_cache_hit_on_the_last():
    r = ChunkReader(num_prompt_tokens=3, top_logprobs=1)
    first = r.push({"choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [
        {"token_id": 9, "logprob": -0.5, "top_logprobs": [{"token_id": 9, "logprob": -0.5},
                                                          {"token_id": 4, "logprob": -1.0}]}]}}]})
    assert first[0].prompt.prompt_tokens == 3 and first[0].logprobs[0].logprob == -0.5
    assert len(first[0].logprobs[0].top) == 1  # top_logprobs as asked, not vLLM's minimum
    assert r.push({"choices": [{"index": 0, "token_ids": [10], "finish_reason": "length"}]}) == []
    r.push({"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}})
    (last,) = r.finish()
    assert list(last.token_ids) == [10] and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.prompt.cached_tokens == 2


def test_an_error_chunk_fails_the_stream():
    with pytest.raises(WireError, match="boom"):
        ChunkReader(3).push({"error": {"message": "boom", "code": 500}})


def test_text_without_token_ids_is_encoded_by_the_gateway():
    r = ChunkReader(3, encode=lambda text: [len(text)])
    assert list(r.push({"choices": [{"index": 0, "text": "abc"}]})[0].token_ids) == [3]


VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
"""

SGLANG_METRICS = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


def test_vllm_and_sglang_metrics_fill_the_load():
    v = engine_load(VLLM_METRICS, "vllm")
    assert (v.num_running, v.num_waiting, v.kv_pages_used / v.kv_pages_total) == (3, 2, 0.25)
    assert (v.prefix_cache_hits_tokens, v.num_steps) == (64, 140)
    s = engine_load(SGLANG_METRICS, "sglang")
    assert (s.num_running, s.num_waiting, s.kv_pages_used / s.kv_pages_total) == (5, 1, 0.5)
    assert engine_load("", "openai") == pb.EngineLoad(kv_pages_total=1000)


def test_the_metrics_scan_sums_label_sets_and_skips_what_it_does_not_read():
    text = VLLM_METRICS + (
        'vllm:num_requests_running{engine="1",model_name="a } b"} 4.0 1700000000000\n'  # a brace in a label, a ts
        'vllm:num_requests_waiting 1\n'  # no labels
        'vllm:num_requests_running_other{engine="0"} 99\n'  # a longer name is another metric
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 7\n'
        'vllm:kv_cache_usage_perc{engine="0"} not-a-number\n')
    v = engine_load(text, "vllm")
    assert (v.num_running, v.num_waiting, v.kv_pages_used) == (7, 3, 250)


def test_request_json_is_serialisable():
    json.dumps(vllm_generate_body(_request(regex="[a-z]+")))

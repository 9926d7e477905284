"""The public HTTP API: OpenAI chat completions and completions, the Responses API, Anthropic's Messages
API, vLLM's tokenizer endpoints, the probes; their request and answer models and the validation that
names a bad field. Each endpoint parses its body into an `ApiRequest` and starts it on the serving path
(gateway/serving/start.py). The top layer: nothing in the gateway's subpackages imports it
(tests/gateway/test_layers.py)."""

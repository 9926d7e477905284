"""Backends: the engines behind the gateway. The client of Duet's own gRPC workers, the fleet of workers
(health, load, KV events), external vLLM / SGLang / OpenAI servers behind the same client interface, and
their KV events. Imports routing's types only (tests/gateway/test_layers.py)."""

"""Serving: one request from a parsed `ApiRequest` to its last byte. Prepare (render and tokenize),
admission, dispatch (route, open the engine stream, retry on another worker), the run (timing, stats,
chunks), stream timeouts and circuit breakers. Imports control, backends and routing, never api
(tests/gateway/test_layers.py)."""

"""Routing: which worker serves a request. Pure and without I/O: the types routing reads and returns, Duet's
policy, the canary arm pick, the prefix tables and the log of recent decisions. The lowest layer of the
gateway: it imports no other subpackage (tests/gateway/test_layers.py)."""

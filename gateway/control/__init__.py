"""Control: what operators and the request path share about the gateway as a whole. The admin API and its
dashboard, automatic canary rollback, the request stats it judges, the pool planner and its tracker, per-key
limits, and the state store (affinity, routing configs, worker registry, stored responses). Imports routing
and backends, never serving or api (tests/gateway/test_layers.py)."""

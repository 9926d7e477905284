"""The load: workloads (synthetic and from traces), the client that sends them, the report of what it measured."""

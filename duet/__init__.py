"""Duet's shared, torch-free code (docs/architecture.md)."""

import os

# Every Duet process that starts children forks only to exec them (duet/supervisor.py, the tests' stacks). gRPC's
# fork handlers, on by default, restart the event engine's poller in the forked child while it closes descriptors
# before exec (a preexec_fn forces a real fork), and the child dies on "epoll_wait: Bad file descriptor" before it
# runs the worker (grpc/grpc#43055, grpcio >= 1.80). With nothing to keep alive across a fork, the handlers go.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

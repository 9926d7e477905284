"""Starting local stacks for the benchmarks: `serving` (engine workers and gateways as child processes, the
benchmark preset of duet/launcher.py), `pinning` (workers on their own cores), `vllm_server` (real vLLM in its
own virtualenv) and `peer_backends` (vLLM behind Duet's gateway)."""

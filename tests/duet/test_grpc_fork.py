"""A child started while this process's gRPC channels are busy gets to exec (duet/__init__.py).

With gRPC's fork handlers on (grpcio's default), a `preexec_fn` forces a real fork whose child restarts gRPC's
poller, closes descriptors before exec and dies now and then on "epoll_wait: Bad file descriptor": here 9 of 150
children on a 2-core machine, which made a worker (and a test) fail to start at random. Importing duet turns the
handlers off; the check runs in a fresh interpreter, where `import duet` comes first, as in every Duet process.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import duet  # first, as in every Duet process: it must turn gRPC's fork handlers off before gRPC starts
import subprocess, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from duet.supervisor import ask_for_parent_death_signal

server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
done = threading.Event()

def busy():
    while not done.is_set():
        stub.Check(health_pb2.HealthCheckRequest())

threads = [threading.Thread(target=busy) for _ in range(3)]
for t in threads:
    t.start()
failed = []
for _ in range(150):
    p = subprocess.run(["/bin/true"], preexec_fn=ask_for_parent_death_signal, capture_output=True)
    if p.returncode != 0 or b"epoll" in p.stderr:
        failed.append((p.returncode, p.stderr.decode(errors="replace")[-200:]))
done.set()
for t in threads:
    t.join()
print(len(failed), failed[:1])
"""


def test_children_forked_beside_busy_grpc_channels_all_reach_exec():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # not inherited from this one
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(" ", 1)[0] == "0", f"children died before exec: {out.stdout}"

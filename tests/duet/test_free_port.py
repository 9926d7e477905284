"""duet.launcher.free_port: a listening port below the kernel's ephemeral range, where the stack's own outgoing
connections (which take their local ports from that range) cannot hold it when the listener binds."""

from __future__ import annotations

import socket

from duet import launcher


def test_ports_are_free_and_below_the_ephemeral_range():
    floor = launcher._ephemeral_floor()
    ports = {launcher.free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        assert launcher._LISTEN_FLOOR <= port < floor
        with socket.socket() as s:  # nothing holds it: a listener can bind it now
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        monkeypatch.setattr(launcher, "_LISTEN_FLOOR", taken)
        monkeypatch.setattr(launcher, "_ephemeral_floor", lambda: taken + 1001)
        for _ in range(20):
            assert launcher.free_port() != taken
    finally:
        held.close()


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(launcher, "_ephemeral_floor", lambda: launcher._LISTEN_FLOOR + 10)
    port = launcher.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))

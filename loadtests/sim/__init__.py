"""Simulators: `routing` (a trace replayed through routing policies over simulated LRU caches), `fleet` (the real
schedulers and router over N simulated workers on a virtual clock) and `calibrate` (the fleet simulator's cost
model measured on real engines)."""

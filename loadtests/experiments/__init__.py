"""The `duet bench` experiments, each over a stack of real processes or a simulator: run, compare, peer,
chaos, advise, simulate-routing, the gateway bench; `stack` is the benchmark preset of duet/launcher.py."""

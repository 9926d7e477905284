"""`duet bench fleet-calibrate`: the fleet simulator's cost model measured on real engines (`steps`: the cpu
step fit; `gateway_timing`, `neighbour`, `in_situ`: its corrections; `h200`: the roofline checked on CUDA)."""

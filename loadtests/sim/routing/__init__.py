"""The routing simulation (`duet bench simulate-routing`): `simulate` replays a trace over simulated workers,
`baselines` holds the routing policies Duet is compared with, `cli` the command's flags."""

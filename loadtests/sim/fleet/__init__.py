"""The fleet simulator (`duet bench fleet`): simulated workers (`engine`) behind the real gateway's decisions
(`simulator`), a step cost model (`cost_models`), the requests from the shipped traces (`workload`), the
figures (`report`, `bench`) and the check against the local stack (`validate`, `step_check`)."""

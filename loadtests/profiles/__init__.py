"""Profilers: the model runner's step (profile_step) and a served worker under load (profile_served)."""

"""`duet bench advise`: paged, prefix or both for a trace. One rule (`rule`) over the options each mode
measures: the routing simulation (`routing_sim`), a local replay (`local`) or the fleet simulator (`fleet`)."""

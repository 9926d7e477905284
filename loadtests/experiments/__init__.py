"""The `duet bench` experiments over real local stacks (loadtests/stack/): compare, classes, chaos, baseline,
diff, peer, the document flood and the gateway bench; each command's flags in its own module (`*_cli`, or
`add_parser` beside a run that imports lazily)."""

"""The control-plane benchmark's parts (`benchmarks/control_plane.py`): simulated engines driving the real
Coordinator actor (`fleet`), the real Router over simulated engine clients (`routing`) on a disaggregated
decision mix (`mix`: the turns, the faulty pairs, the per-run tally), the prefix index's memory (`memory`)
and the report (`report`)."""

"""The live control plane: the scheduler service on the wall clock, its Ray wiring, HTTP
API, Python client, metrics and trace replay against a live fleet."""

"""The bottom layer: shared records, errors, configuration, wire messages, key names, the
rules for session ids and tenant names, and the field readers of untrusted input files.

Every other package (the journal, the core, the simulator, predictors, agents, the live
service and the CLI) may import from here; this package imports nothing from the project
above it.
"""

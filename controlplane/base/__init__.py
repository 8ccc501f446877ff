"""The bottom layer: shared records, errors, configuration, wire messages and key names.

Every other package (the core, the simulator, predictors, agents, the live service and the
CLI) may import from here; this package imports nothing from the project above it.
"""

"""Harnesses that exercise the product from outside: the demos (emulated engine and real
vLLM), the benchmarks (stores, LMCache's L2, SGLang's HiCache, the control plane, the soak,
aiperf), the load generator and the trace replayers against a live fleet.

This layer sits above the live service and the simulator and below the command line
(``kvprefetch demo``, ``kvprefetch bench ...``); nothing in the product packages imports it.
Importing this package imports none of its modules: each is imported by name where used.
"""

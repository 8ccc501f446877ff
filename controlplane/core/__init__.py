"""The scheduling core: pure, deterministic decisions (routing, tier books, eviction,
demand loads, prefetch planning). No clock, no I/O, no Ray; driven by the simulator
(:mod:`kvprefetch.controlplane.sim`) and the live service (:mod:`kvprefetch.controlplane.live`)."""

"""The pure, deterministic core of p2pmesh.

Nothing here touches a socket, a thread, a clock, a process, zeroconf or MLX, and nothing
draws from a module-level random generator: time (``now_ms``) and randomness
(``random.Random``) are arguments. Drivers (the agent) and the simulator (sim/) run the
very same objects; tests/test_layering.py enforces the rule.
"""

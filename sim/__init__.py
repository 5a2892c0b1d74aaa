"""A deterministic discrete-event simulator for p2pmesh's core.

It runs the very same ``p2pmesh.core.machine.Machine`` objects the agent runs, on virtual
time, with a virtual network (latency, loss, duplication, reordering, partitions, cables),
virtual disks (fsync latency, loss of unsynced writes) and seeded faults. Every message
crosses the real wire codec. Everything is a function of the seed: the same seed gives a
byte-identical trace. sim/ imports only p2pmesh.core (tests/test_layering.py checks it).
"""

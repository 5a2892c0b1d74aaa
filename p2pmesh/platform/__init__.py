"""Pure parsers and judgements of what this computer's tools print: Thunderbolt ports
(system_profiler, networksetup, ifconfig, ibv_devices, Linux sysfs and `ip -j`), the checks
of `p2pmesh doctor` (doctor*.py) and the service unit files of `p2pmesh service`
(service_unit.py).

Pure like the core (no I/O, no clock, no module-level random; tests/test_layering.py checks
it) and importing only the core: the drivers, the agent and the CLI run the tools and hand
their output here. The core and the simulator never import it: nothing in it decides what a
cluster does, only what a Mac's tools said.
"""

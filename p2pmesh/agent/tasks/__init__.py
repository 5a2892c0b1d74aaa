"""The agent's tasks. Each takes ports (agent/ports.py: the ClusterView, the Inbox) and its
own config value, never the Agent; the runtime (agent/runtime.py) starts them.

- links.py: this Mac's ports and addresses, link probes, bridge warnings, --configure-links
- measure.py: measuring the committed model on this Mac
- fetch.py: a pending placement's stage files before its worker may start
- peer_copy.py: copying model files from the other Macs, and what this Mac serves them
- workers.py: one MLX worker process per data-plane epoch (the Supervisor)
- pairing.py: `p2pmesh pair`, the host and guest sides over a cable
"""

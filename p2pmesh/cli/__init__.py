"""The `p2pmesh` command line: one module per command, the parser that wires them, and the
rendering they share. `main` is the console script (`p2pmesh`, `python -m p2pmesh`).

  app.py           the parser and the dispatch: each command module adds its subparser (setting
                   its `run` as the default) and app.main calls it
  common.py        what every command shares: exit codes, --state-dir/--socket, reading the status
  agent_cmd.py     p2pmesh agent                 status_cmd.py  status, members
  leave_cmd.py     leave                         ring_cmd.py    ring [solve]
  model_cmd.py     load, model, generate, chat, watch (through the client API)
  links_cmd.py     links [parse|plan|apply]      plan_cmd.py    plan solve
  doctor_cmd.py    doctor                        local_cmd.py   local [--netns]
  service_cmd.py   service install|uninstall|status
  pair_cmd.py      pair [--join]                 key_cmd.py     key show|set
  terminal.py      what people see: members, the ring with its cables, the placement (rich)
  netns.py         Linux namespaces as Macs, for `local --netns`, the multi-host tests and chaos

The CLI is the top layer: nothing outside this package imports it (tests/test_layering.py).
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The `p2pmesh` command. app (and every command module) loads on the first call, so
    importing one piece of the CLI (terminal, netns) does not load the rest."""
    from p2pmesh.cli.app import main as run

    return run(argv)


__all__ = ["main"]

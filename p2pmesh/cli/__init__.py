"""The `p2pmesh` command line: one module per command, the parser that wires them, and the
rendering they share. `main` is the console script (`p2pmesh`, `python -m p2pmesh`).

  app.py           the parser and the dispatch: each command module adds its subparser and runs it
  *_cmd.py         one command each (or one family: model_cmd has load/model/generate/chat/watch)
  terminal.py      what people see: members, the ring with its cables, the placement (rich)
  netns.py         Linux namespaces as Macs, for `local --netns` and the multi-host tests

Nothing outside this package imports it: the CLI is the top layer (tests/test_layering.py).
"""
from p2pmesh.cli.app import main

__all__ = ["main"]

"""python -m p2pmesh: the same as the `p2pmesh` command."""
from p2pmesh.cli import main

raise SystemExit(main())

"""python -m sim: see sim/cli.py."""
from sim.cli import main

raise SystemExit(main())

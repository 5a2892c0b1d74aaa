# Sourced by scripts/demo and scripts/test: make sure .venv exists and holds the
# project with its dev extra. Re-installs only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "p2pmesh: creating $venv" >&2
    "$python" -m venv "$venv"
fi
stamp="$venv/.p2pmesh-installed"
if [[ ! -f "$stamp" || "$root/pyproject.toml" -nt "$stamp" ]]; then
    echo "p2pmesh: installing the project into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet -e "$root[dev]" >&2
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"

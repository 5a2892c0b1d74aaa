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
# The dashboard's browser tests drive Debian's chromium through chromium-driver (no browser
# download). Install them when missing and we may (root with apt-get), bounded and quiet; the
# tests say what is missing otherwise (and fail under CI=true).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "p2pmesh: installing chromium and chromium-driver (the dashboard's browser tests)" >&2
        { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
            --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1 \
            || echo "p2pmesh: could not install chromium; the browser tests will say so" >&2
    fi
fi
export PATH="$venv/bin:$PATH"
cd "$root"

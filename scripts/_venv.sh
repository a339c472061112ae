# Sourced by the scripts: make .venv with the package and its test tools, once per change
# of pyproject.toml. Needs only Python 3.11+ and the package registry.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "Python 3.11+ is needed (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi

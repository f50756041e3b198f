#!/usr/bin/env bash
# Set up everything shoal needs on a fresh machine: a venv with shoal and its test tools,
# and the coding-agent CLIs at the versions package.json pins. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'

if ! command -v npm >/dev/null 2>&1; then
  echo "setup: npm is needed for the coding-agent CLIs (apt-get install nodejs npm)" >&2
  exit 1
fi
# package.json pins exact versions; skip npm when the lock it last installed is unchanged
stamp=node_modules/.shoal-lock-sha
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  npm install --no-audit --no-fund --loglevel=error
  echo "$want" > "$stamp"
fi
for cli in opencode claude codex; do
  test -x "node_modules/.bin/$cli" || { echo "setup: $cli did not install" >&2; exit 1; }
done
echo "setup: ready (.venv, node_modules/.bin: opencode $(node_modules/.bin/opencode --version), codex $(node_modules/.bin/codex --version | awk '{print $2}'), claude $(node_modules/.bin/claude --version | awk '{print $1}'))"

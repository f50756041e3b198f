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
.venv/bin/python -m pip install --quiet -e '.[dev,ray]'  # ray: the hosted-session tests

# System tools the places use, and their tests drive for real: git (worktrees); podman + runc
# and docker.io (containers, from an image the tests build out of busybox-static; for docker
# the tests start a private dockerd of their own, not the system's, which apt may also start
# where systemd runs); openssh-server/-client, sshfs and fuse3 (ssh targets, against a
# throwaway sshd). Installed only when missing, with apt-get as root; anywhere else setup says
# what to install and carries on.
missing=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
have git || missing+=(git)
have podman || missing+=(podman)
have runc || missing+=(runc)
have dockerd || missing+=(docker.io)
have sshd || missing+=(openssh-server)
have ssh || missing+=(openssh-client)
have sshfs || missing+=(sshfs)
have fusermount3 || missing+=(fuse3)
have tmux || missing+=(tmux)  # not a place: `shoal watch`'s end-to-end test drives the view in it
static=$(have busybox && ldd "$(command -v busybox)" 2>&1 || true)  # ldd exits 1 on a static binary
case "$static" in *"not a dynamic"*) ;; *) missing+=(busybox-static) ;; esac
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} (apt-get; a minute or two the first time)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: the places tests need ${missing[*]}; install them (e.g. apt-get install ${missing[*]})" >&2
  fi
fi

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

#!/usr/bin/env bash
# All the set-up kvslots needs on a fresh machine, idempotent (a second run takes seconds):
#   Debian packages (scripts/system-deps.txt), uv, the virtualenv $VENV (default .venv) with the
#   Python deps and Mooncake's transfer engine (requirements/pd.txt), optionally vLLM for CPU
#   (--with-vllm, for the tests), and the Rust extension built in release mode and installed
#   editable.
#   --with-vllm-033 also builds a second environment $VENV033 (default .venv-033) with vLLM 0.33
#   (scripts/install-vllm.sh --vllm-033) that sees this checkout's kvslots, for the tests that
#   run against both vLLM versions (see the Makefile).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
VENV033="${VENV033:-$ROOT/.venv-033}"
WITH_VLLM=0
WITH_VLLM_033=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    --with-vllm-033) WITH_VLLM_033=1 ;;
    *) echo "usage: $0 [--with-vllm] [--with-vllm-033]" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*" >&2; }

# Debian packages (redis-server for the indexer's Redis backend tests, libibverbs1 for Mooncake).
missing=()
while read -r pkg; do
  [[ -z "$pkg" || "$pkg" == \#* ]] && continue
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done <"$ROOT/scripts/system-deps.txt"
if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
      log "not root and no sudo: install these Debian packages first, then run this again:"
      log "  apt-get install -y ${missing[*]}"
      exit 1
    fi
    SUDO="sudo"
    log "not root: using sudo for apt-get (packages: ${missing[*]})"
  fi
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

command -v cargo >/dev/null || { log "cargo (Rust) is required: https://rustup.rs"; exit 1; }
if ! command -v uv >/dev/null; then
  log "installing uv"
  python3 -m pip install -q uv
  hash -r
fi
[[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; uv venv -q --python 3.11 "$VENV"; }

if ((WITH_VLLM)); then
  VENV="$VENV" "$ROOT/scripts/install-vllm.sh"
fi
VIRTUAL_ENV="$VENV" uv pip install -q --python "$VENV/bin/python" -r "$ROOT/requirements/dev.txt"
# Mooncake's transfer engine for disaggregated prefill/decode (requirements/pd.txt says which wheel).
if [[ -n "${KVSLOTS_MOONCAKE_WHEEL:-}" ]]; then
  VIRTUAL_ENV="$VENV" uv pip install -q --python "$VENV/bin/python" "$KVSLOTS_MOONCAKE_WHEEL"
else
  VIRTUAL_ENV="$VENV" uv pip install -q --python "$VENV/bin/python" -r "$ROOT/requirements/pd.txt"
fi
"$VENV/bin/python" -c "from mooncake.engine import TransferEngine" \
  || { log "mooncake's transfer engine does not import (is libibverbs1 installed?)"; exit 1; }

# The extension: rebuilt only when Rust or build files changed since the last build.
stamp="$VENV/.kvslots-build-stamp"
if [[ ! -f "$stamp" ]] || [[ -n "$(find "$ROOT/rust" "$ROOT/Cargo.toml" "$ROOT/pyproject.toml" -newer "$stamp" -type f -print -quit)" ]] \
   || ! "$VENV/bin/python" -c "import kvslots._core" 2>/dev/null; then
  log "building the Rust extension (release)"
  (cd "$ROOT" && VIRTUAL_ENV="$VENV" "$VENV/bin/maturin" develop --release --uv -q)
  touch "$stamp"
fi

if ((WITH_VLLM_033)); then
  VENV="$VENV033" "$ROOT/scripts/install-vllm.sh" --vllm-033
  VIRTUAL_ENV="$VENV033" uv pip install -q --python "$VENV033/bin/python" -r "$ROOT/requirements/dev.txt"
  # kvslots itself: this checkout's package, with the extension the build above put there.
  site="$("$VENV033/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  [[ "$(cat "$site/kvslots.pth" 2>/dev/null)" == "$ROOT/python" ]] || echo "$ROOT/python" >"$site/kvslots.pth"
fi

# Bytecode for everything installed, compiled once here. vLLM on CPU starts its engine core and
# worker as fresh `spawn`ed interpreters, each importing torch and vLLM again; with no .pyc files
# (PYTHONDONTWRITEBYTECODE set, or a venv the tests cannot write) every one of those imports
# compiles ~20k sources: 37 s instead of 15 s per process on a 2-core VM, and the engine tests
# start dozens of them. Redone only when something was installed since (a top-level entry of
# site-packages newer than the stamp); compileall itself skips files whose .pyc is current.
compile_bytecode() {
  local venv="$1" site stamp
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  stamp="$venv/.kvslots-bytecode-stamp"
  if [[ ! -f "$stamp" ]] || [[ -n "$(find "$site" -mindepth 1 -maxdepth 1 -newer "$stamp" -print -quit)" ]]; then
    log "compiling bytecode in $venv (once per install)"
    # A few packages ship sources that do not compile (templates, py2 test data): not an error.
    "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
    touch "$stamp"
  fi
}
# Not $VENV033: only its pytest process imports vLLM 0.33 (no engine is started there), so
# compiling all of it up front would cost more than it saves.
compile_bytecode "$VENV"

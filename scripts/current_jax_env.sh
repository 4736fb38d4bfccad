#!/usr/bin/env bash
# Build the current-JAX test environments on a Debian machine with no Python >= 3.12:
#
#   python   CPython 3.13 built from the source of Debian trixie's python3.13 package
#   a        venv: jax/jaxlib 0.12.0.1 + flax 0.12.12 (today's newest) + jact[test]
#   b        venv: jax/jaxlib 0.11.2 (the GPU machines' JAX) + flax 0.12.12 + jact[test]
#
# Usage: scripts/current_jax_env.sh [a|b|python]...   (default: a b)
# Prints nothing on stdout but, for each venv asked for, its directory. Idempotent: the
# interpreter and each venv carry a stamp of what built them and are rebuilt only when it
# changes. Everything lives under $JACT_ENV_HOME (default ~/.cache/jact-envs), outside the
# repository, so a fresh clone on the same machine reuses it.
#
#   venv=$(scripts/current_jax_env.sh a) && "$venv/bin/python" -m pytest -q -n 2 -m "not slow"
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
home=${JACT_ENV_HOME:-$HOME/.cache/jact-envs}
debian_mirror=${JACT_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' \
  /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)}
debian_mirror=${debian_mirror:-http://deb.debian.org/debian}
python_prefix=$home/python3.13
python_bin=$python_prefix/bin/python3.13

declare -A pins=(
  [a]="jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12"
  [b]="jax==0.11.2 jaxlib==0.11.2 flax==0.12.12"
)

log() { echo "[current_jax_env] $*" >&2; }

build_python() {
  local stamp=$python_prefix/.built-from
  if [[ -x $python_bin && -f $stamp ]] && "$python_bin" -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib' 2>/dev/null; then
    return
  fi
  local work=$home/build-python
  rm -rf "$work" && mkdir -p "$work/lists/partial"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $debian_mirror trixie main" \
    >"$work/sources.list"
  local apt=(apt-get -q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$work/lists")
  log "downloading the source of Debian trixie's python3.13 from $debian_mirror"
  "${apt[@]}" update >&2
  (cd "$work" && "${apt[@]}" source --download-only python3.13 >&2)
  local tarball
  tarball=$(ls "$work"/python3.13_*.orig.tar.xz | head -n 1)
  tar -C "$work" -xf "$tarball"
  local src
  src=$(find "$work" -maxdepth 1 -type d -name 'Python-3.13*' | head -n 1)
  log "building $(basename "$src") into $python_prefix (about 6 CPU-minutes)"
  (cd "$src" && ./configure --prefix="$python_prefix" --with-ensurepip=install >"$work/configure.log" 2>&1 \
    && make -j"$(nproc)" >"$work/make.log" 2>&1 && make install >"$work/install.log" 2>&1) \
    || { log "build failed; logs in $work"; exit 1; }
  "$python_bin" -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib'
  basename "$tarball" >"$stamp"
  rm -rf "$src"
}

build_venv() {
  local name=$1 venv=$home/venv-$1 pins_line=${pins[$1]}
  # The stamp covers the pins and the project's declared dependencies.
  local want
  want=$(printf '%s\n%s\n' "$pins_line" "$(sha256sum "$repo/pyproject.toml" | cut -c1-16)")
  if [[ -x $venv/bin/python && -f $venv/.built-from && $(cat "$venv/.built-from") == "$want" ]]; then
    # Same pins: only point the editable install at this checkout (cheap, no resolution).
    "$venv/bin/python" -m pip install --quiet --no-deps -e "$repo" >&2
    echo "$venv"
    return
  fi
  build_python
  log "creating $venv with $pins_line"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $pins_line -e "$repo[test]" >&2
  echo "$want" >"$venv/.built-from"
  echo "$venv"
}

mkdir -p "$home"
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(a b)
for target in "${targets[@]}"; do
  case $target in
    python) build_python ;;
    a|b) build_venv "$target" ;;
    *) log "unknown target '$target': use a, b or python"; exit 2 ;;
  esac
done

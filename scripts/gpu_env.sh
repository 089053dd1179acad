# Sourced (not run) by the GPU session scripts, after they set OUT and `set -uo pipefail`: the environment
# every device call starts from.
#   1. installs the wheels carried in .whl/: fla-core (the GPU prefill) into /tmp/fla-site, the others (pyzmq:
#      the daemons) into /tmp/site, apart so that the transformers baseline runs as a plain install would
#      (without fla); a wheel that fails to install ends the caller (exit 1);
#   2. exports PYTHONPATH (those two sites, then the checkout; then /tmp/serve-site with the HTTP stack from
#      .whl/serve/ when the host has none: `shardctl serve` in the batch benchmark's HTTP part) and PYTHONUNBUFFERED;
#   3. prints the environment line (nvidia-smi, then the versions) and writes it to $GPU_ENV_FILE.
# .whl/ is not in git; fill it on a machine with the package index (the GPU hosts have none; Python 3.12 there):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
#   pip download --no-deps $P -d .whl pyzmq fla-core py-spy
#   pip download $P -d .whl/serve fastapi uvicorn prometheus_client
# Set before sourcing:
#   GPU_ENV_FILE              where the environment line goes (required)
#   GPU_ENV_VERSIONS          the Python that prints the versions (default: torch, triton and zmq)
#   GPU_ENV_NPROC=1           add the CPU count (nproc) to the line
#   GPU_ENV_WHEELS_OPTIONAL=1 an absent or empty .whl/ is no error (without it, pip refuses the unmatched
#                             pattern and the caller ends, as the scripts needing pyzmq always did)
# A missing nvidia-smi only prints its error: the caller goes on.
: "${GPU_ENV_FILE:?set GPU_ENV_FILE before sourcing scripts/gpu_env.sh}"
export PYTHONUNBUFFERED=1
for wheel in .whl/*.whl; do
    if [ ! -e "$wheel" ] && [ -n "${GPU_ENV_WHEELS_OPTIONAL:-}" ]; then continue; fi
    case "$wheel" in *fla_core*) target=/tmp/fla-site ;; *) target=/tmp/site ;; esac
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$wheel" || exit 1
done
export PYTHONPATH=/tmp/site:/tmp/fla-site:$PWD
export PATH=/tmp/site/bin:$PATH  # the carried wheels' programs (py-spy)
# shardctl serve's HTTP stack (fastapi, uvicorn, prometheus_client and their dependencies) from .whl/serve/, only
# where the host lacks it, and last on the path so that nothing the host has is shadowed
if ls .whl/serve/*.whl > /dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn, prometheus_client" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve-site \
        .whl/serve/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/serve-site
fi
GPU_ENV_VERSIONS=${GPU_ENV_VERSIONS:-'import torch, triton, zmq; print("torch", torch.__version__, "triton", triton.__version__, "zmq", zmq.__version__)'}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    if [ -n "${GPU_ENV_NPROC:-}" ]; then nproc; fi
    python3 -c "$GPU_ENV_VERSIONS"
} | tee "$GPU_ENV_FILE"

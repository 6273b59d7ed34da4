#!/usr/bin/env bash
# ./run.sh          install into .venv if needed, then run the default job (configs/demo.toml)
# ./run.sh test     install the test extras into .venv and Airflow 3 into .venv-airflow if needed, then run the test suite
# ./run.sh ARGS...  anything else is passed to `lengthwise run --config configs/demo.toml`
set -euo pipefail
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1

PYTHON=${PYTHON:-python3}
# torch is installed first and pinned, so pip never picks a multi-GB build by accident. On this
# project's machines pip resolves torch==2.13.0 to a CPU wheel kept on local disk; elsewhere PyPI
# serves its default (CUDA) build. Set LENGTHWISE_TORCH to choose another build or version.
TORCH_SPEC=${LENGTHWISE_TORCH:-torch==2.13.0}

ensure_installed() {  # $1: "" or "test" — the extra to install; reinstalls when pyproject.toml or the torch spec change
    local extra=$1 stamp=".venv/.installed${1:+-$1}"
    local want
    want=$( (cat pyproject.toml; echo "$TORCH_SPEC") | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "$TORCH_SPEC"
    .venv/bin/python -m pip install --quiet -e ".${extra:+[$extra]}"
    echo "$want" > "$stamp"
}

# Airflow 3 for tests/integrations/test_airflow.py, in a venv of its own: the operators run lengthwise as a
# child process, so Airflow's environment holds no torch, and its ~90 packages stay out of .venv's resolution.
AIRFLOW_SPEC="apache-airflow==3.3.2 apache-airflow-providers-standard==1.21.0"

ensure_airflow_installed() {  # reinstalls when the pinned versions change
    local stamp=".venv-airflow/.installed" want
    want=$(echo "$AIRFLOW_SPEC" | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    [ -x .venv-airflow/bin/python ] || "$PYTHON" -m venv .venv-airflow
    .venv-airflow/bin/python -m pip install --quiet --upgrade pip
    # shellcheck disable=SC2086  # the spec is two requirements
    .venv-airflow/bin/python -m pip install --quiet $AIRFLOW_SPEC
    echo "$want" > "$stamp"
}

if [ "${1:-}" = "test" ]; then
    shift
    ensure_installed test
    ensure_airflow_installed
    exec .venv/bin/python -m pytest "$@"
fi
ensure_installed ""
exec .venv/bin/lengthwise run --config configs/demo.toml "$@"

#!/usr/bin/env bash
# Installs the official schema checkers for deploy/kubernetes/: PyPI `kubernetes-validate` (the
# built-in kinds: Namespace, DaemonSet) in a venv, and npm `@kubernetes-models/prometheus-operator`
# (the Prometheus operator's PodMonitor and PrometheusRule models). Cache: ${PROBE_CACHE:-~/.cache/probe}/
# kube-validate; a minute the first time, instant after. Prints KUBE_VALIDATE=... (that folder).
# Both through their ordinary clients (pip, npm), so the user's configured index and proxy apply.
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
KV_VERSION="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
PO_VERSION="${PROMETHEUS_OPERATOR_MODELS_VERSION:-6.0.0}"
say() { printf 'manifests: %s\n' "$*" >&2; }
die() { printf 'manifests: error: %s\n' "$*" >&2; exit 1; }

dir="$CACHE/kube-validate"
stamp="$dir/.probe-$KV_VERSION-$PO_VERSION"   # written last, so an interrupted install is redone
if [ ! -e "$stamp" ]; then
  command -v npm >/dev/null || die "npm is missing (scripts/setup.sh installs it)"
  rm -rf "$dir"
  mkdir -p "$dir"
  say "installing kubernetes-validate $KV_VERSION with pip"
  python3 -m venv "$dir/venv" || die "cannot create a virtual environment in $dir/venv"
  "$dir/venv/bin/python" -m pip install -q "kubernetes-validate==$KV_VERSION" >&2 \
    || die "pip install kubernetes-validate==$KV_VERSION failed (check your pip index or proxy configuration)"
  say "installing @kubernetes-models/prometheus-operator $PO_VERSION with npm"
  (cd "$dir" && echo '{"name":"probe-manifests","private":true}' > package.json \
    && npm install --silent --no-audit --no-fund "@kubernetes-models/prometheus-operator@$PO_VERSION" >&2) \
    || die "npm install @kubernetes-models/prometheus-operator@$PO_VERSION failed (check your npm registry configuration)"
  touch "$stamp"
fi
echo "KUBE_VALIDATE=$dir"

#!/usr/bin/env bash
# fairseq2 needs the system library libsndfile1. Install it when we can
# (root), otherwise fail with the exact instruction.
set -euo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libsndfile\.so\.1'; then
    exit 0
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing libsndfile1 (needed by fairseq2)..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsndfile1 >/dev/null
    exit 0
fi

echo "error: fairseq2 needs the system library libsndfile1. Install it with: apt-get install -y libsndfile1" >&2
exit 1

#!/usr/bin/env bash
# Usage: check_free_disk.sh GIB
# Fails, naming the shortfall, when the directory pytest puts its temporary
# files in (TMPDIR, else /tmp) has less than GIB GiB free: the tests' training
# runs write checkpoints there, and a disk that fills up midway fails tests far
# from the cause ("No space left on device" in whatever writes next).
set -euo pipefail

required_gib=${1:?usage: check_free_disk.sh GIB}
dir=${TMPDIR:-/tmp}

if [ ! -d "$dir" ]; then
    echo "error: TMPDIR must be a directory, but ${dir} is not." >&2
    exit 1
fi

free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
free_gib=$((free_kib / 1024 / 1024))

if [ "$free_kib" -lt $((required_gib * 1024 * 1024)) ]; then
    echo "error: the tests need ${required_gib} GiB free in ${dir} (their peak), but it has ${free_gib} GiB free instead. Free space there, or set TMPDIR to a directory with more." >&2
    exit 1
fi

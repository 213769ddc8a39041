"""A real SLURM cluster for the tests of ``slurm/``: munged, slurmctld and two
slurmd (two emulated nodes) on localhost, started once per test session by
``scripts/slurm_local_up.sh`` and stopped by PID afterwards.

Needs root (munged, slurmd, installing the Debian packages when they are
missing); without it the cluster tests are skipped, with that reason. A file
lock keeps two test sessions on one machine from sharing the cluster.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import IO

import pytest
from slurm_cluster import (
    CLUSTER_DIR,
    CLUSTER_PORT,
    CPUS_PER_NODE,
    GPUS_PER_NODE,
    LOCK_FILE,
    LOCK_TIMEOUT_S,
    NUM_NODES,
    REPO,
    Cluster,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: runs jobs on a real SLURM cluster on localhost (needs root)"
    )


def _acquire_lock() -> IO[str]:
    handle = LOCK_FILE.open("a+")
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                pytest.fail(
                    f"another test session has held {LOCK_FILE} for {LOCK_TIMEOUT_S} s"
                )
            time.sleep(1)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """Starts the cluster for the session and stops its daemons by PID."""
    if os.geteuid() != 0:
        pytest.skip(
            "the SLURM tests start munged, slurmctld and slurmd (and install them "
            "with apt-get if missing), which needs root"
        )

    lock = _acquire_lock()
    cluster_env = dict(
        os.environ,
        QWEN35_SLURM_DIR=str(CLUSTER_DIR),
        QWEN35_SLURM_PORT=str(CLUSTER_PORT),
        QWEN35_SLURM_NODES=str(NUM_NODES),
        QWEN35_SLURM_CPUS=str(CPUS_PER_NODE),
        QWEN35_SLURM_GPUS=str(GPUS_PER_NODE),
    )
    down = [str(REPO / "scripts" / "slurm_local_down.sh")]
    try:
        proc = subprocess.run(
            [str(REPO / "scripts" / "slurm_local_up.sh")],
            env=cluster_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            subprocess.run(down, env=cluster_env, timeout=120)
            pytest.fail(f"the SLURM cluster did not start:\n{proc.stderr}")

        env = dict(os.environ, SLURM_CONF=str(CLUSTER_DIR / "slurm.conf"))
        head = subprocess.run(
            ["hostname", "-s"], capture_output=True, text=True, check=True
        ).stdout.strip()
        try:
            yield Cluster(CLUSTER_DIR, env, head)
        finally:
            subprocess.run(down, env=cluster_env, timeout=120)
    finally:
        lock.close()


@pytest.fixture(scope="session")
def shellcheck() -> str:
    """The shellcheck command, installed from Debian's package when missing
    and we are root."""
    path = shutil.which("shellcheck")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, timeout=300)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"],
            env=env,
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
        )
        path = shutil.which("shellcheck")
    if path is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    return path

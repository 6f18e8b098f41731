"""Runs a test script in a fresh Python whose JAX has several CPU devices: the backend of
the test process is already running with one, and the device count is fixed at start-up."""

import json
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_cpu_devices(script: str, devices: int, timeout: int = 600) -> dict:
    """The JSON the script prints after ``RESULT`` on its last such line. The script gets
    ``devices`` CPU devices, the repository on its path, and this process's persistent
    compilation cache directory as ``CACHE_DIR`` (empty when there is none)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    env["CACHE_DIR"] = jax.config.jax_compilation_cache_dir or ""
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])

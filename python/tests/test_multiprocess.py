"""Ranks as processes: hsap.Comm.from_process_group under torchrun (gloo, CPU tensors,
the host backend's shared-memory transport), a layout mismatch, and a rank killed mid-run."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hsap

HERE = Path(__file__).resolve().parent
PYTHON = Path(sys.executable)
TORCHRUN = PYTHON.with_name("torchrun")


def _host_processes_supported() -> str:
    """'' when this libhsap.so makes host ranks in processes, else why not."""
    try:
        with hsap.Comm.init_rank(1, hsap.get_unique_id(), 0, backend="host") as comm:
            comm.size
        return ""
    except hsap.HsapError as e:
        return str(e)


_WHY_NOT = _host_processes_supported()
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=f"no host ranks in processes: {_WHY_NOT}")


def _shm_entries():
    try:
        return {n for n in os.listdir("/dev/shm") if "hsap" in n}
    except FileNotFoundError:
        return set()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(mode, nproc):
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", str(HERE / "mp_worker.py"),
           mode]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("mode", ["ok", "mismatch"])
def test_torchrun(mode):
    before = _shm_entries()
    nproc = 3 if mode == "ok" else 2
    proc = _torchrun(mode, nproc)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    for r in range(nproc):
        assert f"RANK {r} {mode.upper()} OK" in log, log
    assert _shm_entries() <= before, "shared-memory segments left behind"


def test_killed_rank_gives_timeout_or_abort_not_a_hang():
    # Own launcher: torchrun would tear down the survivors as soon as one rank dies.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = _shm_entries()
    procs = []
    for r in range(2):
        env = _env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([str(PYTHON), str(HERE / "mp_worker.py"), "death"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
            pytest.fail("a rank hung after its peer died:\n" + "\n".join(outs))
    assert procs[1].returncode == -9, outs[1]
    assert procs[0].returncode == 0 and "RANK 0 DEATH OK" in outs[0], outs[0]
    assert _shm_entries() <= before, "shared-memory segments left behind"

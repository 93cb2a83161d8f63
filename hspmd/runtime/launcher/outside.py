"""Running as one rank of an MPI job that an outside launcher started (`srun`, `mpirun`, `mpiexec`).

`hspmd run` started in every rank of such a job (`mpiexec -n 2 hspmd run -n 2 SCRIPT`, an
`sbatch` script's `srun hspmd run SCRIPT`, Open MPI's `mpirun --hostfile H hspmd run SCRIPT`)
finds the job from the environment its process manager set (`outside_job`) and runs as that
rank: it starts no `mpiexec` of its own. `-n`, where given, must be the job's size.

Rank 0 compiles the script and hands the bundle to the others over MPI (`share_bundle`): one
compile for the job, and no file system shared between the hosts is needed for it.

The environment names read, in this order (the first launcher whose rank and size are both set):

| launcher | rank | size | rank on its host | ranks on its host |
| --- | --- | --- | --- | --- |
| Open MPI (`mpirun`, `srun` with PMIx) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
| MPICH Hydra (`mpiexec`), PMI-1/2 (`srun --mpi=pmi2`) | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` | `MPI_LOCALNRANKS` |
| PMIx (`srun --mpi=pmix`) | `PMIX_RANK` | `SLURM_STEP_NUM_TASKS` | `SLURM_LOCALID` | - |
| Slurm (`srun`) | `SLURM_PROCID` | `SLURM_STEP_NUM_TASKS` | `SLURM_LOCALID` | - |

Slurm's size is the job step's (`SLURM_STEP_NUM_TASKS`, set by `srun` only): an `sbatch` script
itself has `SLURM_PROCID=0` and `SLURM_NTASKS` too, and `hspmd run` started there directly (not
under `srun`) launches its ranks itself, as on a workstation.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["OutsideJob", "outside_job", "prepare_rank_environment", "share_bundle"]

#: (launcher, rank, size, local rank, local size) variables, in the order looked at
_LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH Hydra / PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIx", "PMIX_RANK", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
    ("Slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)


@dataclass(frozen=True)
class OutsideJob:
    """This process's place in an MPI job another launcher started."""

    launcher: str  # which environment said so (the table of the module docstring)
    rank: int
    size: int
    local_rank: int  # its index among the job's ranks on this host (picks its GPU)
    local_size: int | None  # the job's ranks on this host, where the launcher says


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    value = env.get(name, "") if name else ""
    return int(value) if value.strip().isdigit() else None


def outside_job(env: Mapping[str, str] | None = None) -> OutsideJob | None:
    """Return the MPI job this process is a rank of (from `env`, default this process's), None
    where no launcher's rank and size are both set (a plain shell)."""
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None or size is None or not 0 <= rank < size:
            continue
        local = _int(env, local_var)
        return OutsideJob(launcher, rank, size, rank if local is None else local, _int(env, local_size_var))
    return None


def prepare_rank_environment(job: OutsideJob) -> None:
    """Give this rank its share of its host's cores for its math libraries, before MPI starts
    (what `hspmd.runtime.launcher.launch.rank_environment` gives the ranks `hspmd run` starts itself).

    Thread counts the environment sets already are kept; BLAS, loaded with NumPy before the
    command line is read, gets the share through threadpoolctl."""
    from hspmd.runtime.launcher.launch import THREAD_VARIABLES, YIELDING_WAITS, usable_cores

    local = job.local_size or 1
    share = max(1, usable_cores() // local)
    given = {name for name in THREAD_VARIABLES if name in os.environ}
    for name in THREAD_VARIABLES:
        os.environ.setdefault(name, str(share))
    if local > usable_cores():  # ranks share cores: MPI's waits give the core away (launch.YIELDING_WAITS)
        for name, value in YIELDING_WAITS.items():
            os.environ.setdefault(name, value)
    if not given & {"OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}:
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(share, user_api="blas")
        except ImportError:  # pragma: no cover - a dependency of the package
            pass


class BundleNotShared(Exception):
    """Rank 0 could not compile the bundle (it says why); this rank ends quietly."""


def _wait(request) -> None:
    """Return once MPI `request` completes, sleeping between looks: the ranks waiting for rank 0's
    compile leave it the cores (a blocking wait polls without pause)."""
    while not request.Test():
        time.sleep(0.005)


def share_bundle(comm, bundle: str | None, error: str | None = None, directory: str | None = None) -> str:
    """Return the path of the bundle on this rank: rank 0 gives its directory `bundle` (or the
    `error` it met compiling it); every other rank gets the files over MPI (`comm`: mpi4py's
    world) and writes them to a new temporary directory (in `directory`, where given). BundleNotShared on the other ranks where
    rank 0 gives an error."""
    if comm.Get_rank() == 0:
        names, blobs = [], []
        if error is None:
            for root, _, files in os.walk(bundle):
                for f in sorted(files):
                    path = os.path.join(root, f)
                    names.append(os.path.relpath(path, bundle))
                    with open(path, "rb") as fh:
                        blobs.append(fh.read())
        header = "\n".join(["error:" + error] if error is not None else names).encode()
        sizes = np.array([len(header), *(len(b) for b in blobs)], dtype=np.int64)
        count = np.array([len(sizes)], dtype=np.int64)
        _wait(comm.Ibcast(count, root=0))
        _wait(comm.Ibcast(sizes, root=0))
        payload = np.frombuffer(header + b"".join(blobs), dtype=np.uint8)
        _wait(comm.Ibcast(payload, root=0))
        return bundle or ""
    count = np.zeros(1, dtype=np.int64)
    _wait(comm.Ibcast(count, root=0))
    sizes = np.zeros(int(count[0]), dtype=np.int64)
    _wait(comm.Ibcast(sizes, root=0))
    payload = np.empty(int(sizes.sum()), dtype=np.uint8)
    _wait(comm.Ibcast(payload, root=0))
    data = payload.tobytes()
    header, offset = data[:sizes[0]].decode(), int(sizes[0])
    if header.startswith("error:"):
        raise BundleNotShared(header[len("error:"):])
    out = tempfile.mkdtemp(prefix=f"hspmd-bundle-r{comm.Get_rank()}-", dir=directory)
    for name, size in zip(header.split("\n") if header else [], sizes[1:]):
        path = os.path.join(out, name)
        if os.path.isabs(name) or os.path.normpath(name).startswith(".."):
            raise BundleNotShared(f"rank 0 sent a bundle file outside the bundle: {name}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data[offset:offset + int(size)])
        offset += int(size)
    return out

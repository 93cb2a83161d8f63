"""The messages between workers and servers (mpi4py point-to-point, pickled; arrays as NumPy).

worker -> server
    PULL  (step, {name: rows or None})         rows: int64 ids of a table's rows; None: all of it
    PUSH  (step, {name: (rows or None, grad)}) the worker's gradient of its rows of the batch
    DONE  {name: (rows, grad)}                 the worker has trained its last step (with the
                                               HET cache's gradients not pushed yet)
    ALIVE None                                 the worker's heartbeat (`Heartbeat`, from a thread, so
                                               a worker computing a long step is not silent)
server -> worker
    REPLY (step, {name: values}, staleness, clocks)  values of the rows (or whole parameter)
          asked for; staleness: how many steps the slowest live worker is behind the asking one;
          clocks: every worker's pushed steps
    HEARTBEAT None  the pull is still waiting on the clocks (the server is alive), sent every
          half `--silent-after` seconds while it waits
    END   {worker: step}  the server has ended (every worker is done or lost); the workers it lost
          and the step each was lost at (a rank of a run that lost one must not call
          MPI_Finalize, which waits for every rank of the job)
"""

PULL, PUSH, DONE, REPLY, HEARTBEAT, ALIVE, END = 11, 12, 13, 14, 15, 16, 17


def message_bytes(payload) -> int:
    """Return the bytes of the arrays in a message payload (what a pull or a push moves)."""
    import numpy as np

    if isinstance(payload, np.ndarray):
        return payload.nbytes
    if isinstance(payload, dict):
        return sum(message_bytes(v) for v in payload.values())
    if isinstance(payload, (tuple, list)):
        return sum(message_bytes(v) for v in payload)
    return 0


#: how long a rank that waits for a message sleeps between looks (MPICH's blocking receive
#: spins on a core; a server or a waiting worker must leave its core to the ranks that compute)
POLL_S = 0.0002


class Silence(TimeoutError):
    """No message came within the time a rank waits for one."""


class Unreadable(RuntimeError):
    """A message came but could not be read: its sender died while sending it (`source`)."""

    def __init__(self, source: int, why: str) -> None:
        super().__init__(f"a message from rank {source} could not be read ({why})")
        self.source = source


def send(comm, payload, dest: int, tag: int, timeout: float) -> None:
    """Send `payload` to `dest` without blocking forever: raise `Silence` if the send has not
    completed within `timeout` seconds (a large message waits for its receiver, which may be gone)."""
    import time

    request = comm.isend(payload, dest=dest, tag=tag)
    start = time.monotonic()
    while not request.Test():
        if time.monotonic() - start > timeout:
            raise Silence(f"a message to rank {dest} was not taken in {timeout:g} s")
        time.sleep(POLL_S)


class Heartbeat:
    """A thread that sends ALIVE to `dests` every `period` seconds until `stop()`.

    A server counts a worker from which nothing came for `--silent-after` seconds as lost; the
    heartbeat keeps a live worker heard while it computes a step of any length (as ps-lite's
    heartbeats do). MPI is initialised with MPI_THREAD_MULTIPLE (mpi4py's default)."""

    def __init__(self, comm, dests: list[int], period: float) -> None:
        import threading

        self.comm, self.dests, self.period = comm, list(dests), period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hspmd-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _beat(self) -> None:
        sends = []
        while not self._stop.wait(self.period):
            sends = [r for r in sends if not r.Test()]
            if len(sends) < 4 * len(self.dests):  # a receiver that takes nothing gets no more
                sends += [self.comm.isend(None, dest=d, tag=ALIVE) for d in self.dests]

    def stop(self) -> None:
        """Stop beating (returns once the thread has ended; again: nothing)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def wait_for(comm, source: int, tag: int, timeout: float | None = None, on_idle=None):
    """Return (payload, source, tag) of the next message from `source` with `tag` (MPI.ANY_* allowed),
    sleeping between looks instead of spinning. Raises `Silence` after `timeout` seconds without
    one, `Unreadable` if its sender died while sending it; calls `on_idle()` about every 0.1 s of
    waiting."""
    import time

    from mpi4py import MPI

    status = MPI.Status()
    start = last = time.monotonic()
    while not comm.Iprobe(source=source, tag=tag, status=status):
        time.sleep(POLL_S)
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            raise Silence(f"no message in {timeout:g} s")
        if on_idle is not None and now - last > 0.1:
            on_idle()
            last = now
    try:
        payload = comm.recv(source=status.Get_source(), tag=status.Get_tag())
    except MPI.Exception as err:  # a large message is copied from its sender's memory as it is read
        raise Unreadable(status.Get_source(), err.Get_error_string().splitlines()[0]) from None
    return payload, status.Get_source(), status.Get_tag()

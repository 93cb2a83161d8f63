"""The messages between workers and servers (mpi4py point-to-point, pickled; arrays as NumPy).

worker -> server
    PULL  (step, {name: rows or None})         rows: int64 ids of a table's rows; None: all of it
    PUSH  (step, {name: (rows or None, grad)}) the worker's gradient of its rows of the batch
    DONE  {name: (rows, grad)}                 the worker has trained its last step (with the
                                               HET cache's gradients not pushed yet)
server -> worker
    REPLY (step, {name: values}, staleness)    values of the rows (or whole parameter) asked
          for; staleness: how many steps the slowest live worker is behind the asking one
"""

PULL, PUSH, DONE, REPLY = 11, 12, 13, 14


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

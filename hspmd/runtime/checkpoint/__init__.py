"""Checkpoints.

* Sharded checkpoints (`manifest`, `writer`, `reader`, `files`): during training each rank writes
  the distinct pieces it holds of every parameter and optimizer state to safetensors files, in the
  background; a JSON manifest says where every slice of every global tensor lies. A run resumes
  from one under any strategy and device count, each rank reading only the pieces its layout
  needs (see docs/checkpoints.md).
* The final parameters gathered on rank 0 into one `.npz` (`gathered`, `hspmd run --checkpoint`).
"""

from hspmd.runtime.checkpoint.gathered import gather_parameters, load_checkpoint, save_checkpoint

__all__ = ["gather_parameters", "load_checkpoint", "save_checkpoint"]

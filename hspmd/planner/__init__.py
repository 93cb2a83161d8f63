"""The planner: picks a strategy for a model script and a set of devices (`hspmd plan`).

Three steps, one module each:

1. `facts.model_facts(script)` compiles a few probe strategies of the script once (one device,
   tp=2, pp=2, and tp degrees for feasibility) and reads from their IR what every strategy's cost
   is made of: matmul FLOPs and elementwise bytes per step, parameter, gradient and optimizer
   bytes, activation memory, the bytes and calls of tensor-parallel collectives and of pipeline
   sends, the layer count and the batch rows.
2. `machine.Machine` is what the planner knows of the devices: each rank's matmul rate (by
   matmul size) and elementwise rate, and the time of a collective over a group (the
   latency-bandwidth model of the slowest link). It comes from a measured `DeviceProfile`
   (`hspmd profile`) or, without one, assumes every rank alike.
3. `search.plan(facts, machine, ...)` groups devices of like speed, enumerates dp/tp/pp/zero
   (sp beside tp, ep for mixture-of-experts models) and micro-batch counts per group, splits
   the batch between groups in proportion to their speed (then moves rows one by one while the
   slowest group gains), prices every candidate with `cost.group_cost` and returns them
   ranked, each with its predicted step time, memory per rank and what dominated its time.

The planner's output is strategy text that `--strategy` accepts, so a person can read and edit it.
"""

from hspmd.planner.facts import ModelFacts, model_facts
from hspmd.planner.machine import Machine
from hspmd.planner.search import Candidate, PlanError, plan

__all__ = ["Candidate", "Machine", "ModelFacts", "PlanError", "model_facts", "plan"]

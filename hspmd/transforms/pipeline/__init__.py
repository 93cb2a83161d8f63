"""Pipeline parallelism: the virtual-device mapping of pipelined groups, and the passes that cut a
physical step into one program per stage.

A pipelined group is annotated as one stage on virtual devices (micro-batches x dp as dp;
`virtual.py` owns that mapping). After `specialize-groups, lower-reshard`, for each pipelined
group in turn (`pipeline-split` runs them in this order, `split.py`):

    assign-pipeline-stages   assign_stages.py   writes `pipeline.stage = S` on each op of the step
                             (balance.py: layers and their cost-balanced counts)
    outline-pipeline-stages  outline_stages.py  reads it: one module per stage, `pipeline.run` of a
                             forward and a backward over the micro-batches, send/recv between stages
                             (stage_builder.py, microbatches.py); marks cross-group collectives
                             `pipeline.cross = k`
    join-pipeline-groups     join_groups.py     beside other groups: remaps and re-orders them
    shard-stage-optimizer    shard_stage_optimizer.py   ZeRO over each stage's dp ranks (once, last)

Shared facts: `group.py` finds and checks the stage-shaped group, `stage_mesh.py` maps virtual
devices onto stages and classifies collectives, `devices.py` renames devices in ops.
"""

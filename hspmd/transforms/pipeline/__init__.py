"""Pipeline parallelism: the virtual-device mapping of pipelined groups, and the passes that cut a
physical step into one program per stage."""

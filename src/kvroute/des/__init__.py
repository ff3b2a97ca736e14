"""The discrete-event fleet simulator behind ``kvroute simulate`` (design.md, section 4.1).

The same engine model (engine/), Fleet, policies and cost model (core/), workloads and
load shapes (bench/) as the HTTP rig, driven by an event heap in virtual time:

- ``events``: the heap; ``backend``: an engine as events, with decode fast-forward;
- ``router``: the Fleet in the loop, learning what the live router learns, when it would;
- ``clients``: the load generator's modes in virtual time;
- ``prompts``: prompt text to token ids with a chunk cache; ``ceilings``: infinite,
  pooled-LRU and Belady hit rates of what a run sent;
- ``simulation``: one router's run; ``report`` and ``cli``: the command.
"""

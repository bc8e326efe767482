"""The planner: which parallel layout to pick, whether it fits, and how fast it will be.

Map (one idea per file):
  data/           GPU datasheet numbers and model config.json presets, each citing its source
  hardware.py     GpuSpec / Cluster / Link; catalog.py model presets; calibrate.py this machine
  shard.py        parameters per rank under TP (uneven heads, KV replication), PP, EP
  activations.py  training activations (Korthikanti et al. 2022); zero.py ZeRO model states
  memory.py       the per-GPU memory breakdown
  roofline.py     per-layer FLOPs and bytes; comm.py alpha-beta collectives
  traffic.py      training's memory-bound operators (norms, activations, loss, Adam): their bytes
  inference.py    TTFT / TPOT / throughput; serving.py the same at a concurrency or arrival rate
  training.py     step time, MFU
  schedule.py     GPipe / 1F1B / interleaved / ZB-H1 timelines
  search.py       every valid layout, scored; explain.py rules and the why; planner.py plan()
  report.py, plot.py, cli.py   table / JSON, pictures, ``shardlm plan``
"""

"""The shape planner behind `raypd config --plan`: which engines to run on a box, and in which roles.

Pure Python (no Ray, no vLLM). One module per step, each importing only those above it:

  profile.py     HardwareProfile, EngineProfile: a model's measured rates on the hardware (load_profile)
  workload.py    Workload (prompt mix, output length, rates), SloTargets (TTFT, TPOT)
  shapes.py      Shape: engines per role and their sizes; enumerate_shapes
  simulate.py    simulate: one shape under one workload at one rate, step by step -> RateResult
  deployment.py  a shape as raypd's deployment (DeploymentConfig, YAML) and the step limits it runs with
  plan.py        plan: every shape at every rate, the chosen one; render_table
  live.py        scale_advice: the live pools simulated as they are and one engine more or fewer (the autoscaler)
"""

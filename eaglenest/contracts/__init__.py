"""The single owner of every cross-stage fact. Stages read these facts from here, never restate them:

- ``target``: TargetSpec, the one reader of a target folder (config, eos, dtype, embed/lm_head shapes and tensors)
- ``layers``: physical <-> SGLang/vLLM layer ids (and SGLang's first-id rule)
- ``shards``: the hidden-state shard schema + manifest; ``states``: which positions' states training reads
- ``drafter_config`` / ``drafter_format``: the drafter's hyperparameters; the export folder + sidecar, written and
  read only there
- ``preflight``: every drafter x target x algorithm x engine check, and ``derive_algorithm``
- ``metrics``: every metric's name, type, help, tags and buckets (code, dashboard, alerts and tests read them here),
  and the one ``accept_length`` formula
- ``sharegpt``: the ShareGPT speaker -> role table (regen's adapter and the GPU stand-in builder)
"""

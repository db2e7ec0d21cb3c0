"""The single owner of every cross-stage fact: layer ids, the shard schema, and (as they move here) the target
spec, the drafter export format, preflight and metric names. Stages read these facts from here, never restate them."""

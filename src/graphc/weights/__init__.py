"""Stored weights: reading and checking a checkpoint (config.json, safetensors headers, the
families' layouts through their records), loading a rank's shard, the formats weights are kept in
as stored (FP8 block-scaled, FP4 experts), a rank's tensor-parallel slice, shapes-only models from
config.json alone, and the tiny checkpoints tests and the quick start make. The model contract
(`graphc.models`) is what they load into."""

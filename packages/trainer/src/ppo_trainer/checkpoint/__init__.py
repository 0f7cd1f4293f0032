"""Checkpoints of a training role: one folder of whole tensors in Hugging Face names, either backend.

- ``format``: the folder's files (layout, RNG states, tokenizer copy, ``trainer_state.json``, commit);
- ``optimizer_format``: ``optimizer.pt``'s AdamW state dict, and Adam's moments to and from megatron;
- ``torch_optimizer``: the torch backend's AdamW state (made eagerly, keyed by name, gathered, loaded);
- ``protocol``: ``TorchCheckpointable``, what ``torch_io``, ``sharded`` and ``saves`` read of a torch
  trainer (the model, AdamW, where the rank sits), so that they do not import the backend;
- ``torch_io``: the torch backend's save and load (replicated or FSDP2, resident or from host copies);
- ``megatron_io``: the megatron backend's save and load, through ``TrainerBackend`` alone, and its
  ``DistributedOptimizer``'s shards to and from ``optimizer.pt``'s dict (``OptimizerShards``);
- ``sharded``: an asleep FSDP2 role's shards gathered by the writers over a group of their own;
- ``background``: a shard written by a thread while the worker goes on;
- ``saves``: one worker rank's saves, loads and commits (``RankCheckpoints``).

Import the modules themselves; this package imports nothing, so that each stays a leaf of its own.
"""
